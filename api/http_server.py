"""The OpenAI-compatible HTTP front: its own process, a ZMQ client of the core like any other.

    python -m memstep.api.http_server --zmq tcp://127.0.0.1:5557 --port 8000

`memstep serve` starts it (see `api/http_front.py`).  Endpoints: `POST /v1/completions`,
`POST /v1/chat/completions` (SSE with `stream: true`), `GET /v1/models`, `GET /health` (200 only
while the core says "ok"), `GET /metrics`.  Every request goes through `AsyncClient`: one codec,
one path into the engine, and no torch in this process.  A client that disconnects aborts its
requests in the core.  With an API key, `/v1/*` needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from memstep.api import openai_protocol as oai
from memstep.api.client import AsyncClient, AsyncStream, ServerError
from memstep.api.metrics import Metrics
from memstep.api.openai_protocol import Job, OpenAIError
from memstep.api.tool_calls import CallStream
from memstep.core.logging import setup_logging
from memstep.events.wire import GenerateDone, HealthReply

log = structlog.get_logger("memstep.http")

HEALTH_TIMEOUT_S = 2.0
CORE_TIMEOUT_S = 600.0  # a request's silence before it fails: one step may be long on a busy CPU
CLIENT_ERRORS = {"invalid_request", "invalid_field", "missing_field", "unknown_field"}
UNAVAILABLE = {"executor_dead", "executor_error", "recovering"}


class Front:
    """Owns the ZMQ client of the core, the model's name and the metrics; answers HTTP."""

    def __init__(self, address: str, model: str, api_key: str | None, curve: dict[str, str]):
        self.address = address
        self.model = model
        self.api_key = api_key
        self.curve = curve
        self.client: AsyncClient | None = None
        self.ready_fd: int | None = None  # written to once serving
        self.core_timeout = CORE_TIMEOUT_S
        self.created = int(time.time())
        self.prom = Metrics()
        self.aborts: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.client = AsyncClient(self.address, timeout=self.core_timeout, **self.curve)
        log.info("http front ready", core=self.address, model=self.model)
        if self.ready_fd is not None:
            os.write(self.ready_fd, b"ready\n")
            os.close(self.ready_fd)
        try:
            yield
        finally:
            await self.client.close()

    @property
    def core(self) -> AsyncClient:
        assert self.client is not None, "the front is not started"
        return self.client

    # --- endpoints -------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, oai.parse_completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, oai.parse_chat)

    async def models(self, request: Request) -> Response:
        self._check_key(request)
        card = {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "memstep",
            "root": self.model,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        try:
            reply: HealthReply = await asyncio.wait_for(self.core.health(), HEALTH_TIMEOUT_S)
        except (TimeoutError, ServerError) as exc:
            return JSONResponse({"status": "unreachable", "detail": str(exc)}, 503)
        body = {"status": reply.status, "detail": reply.detail, "model": reply.model}
        return JSONResponse(body, 200 if reply.status == "ok" else 503)

    async def metrics(self, request: Request) -> Response:
        try:
            stats = await asyncio.wait_for(self.core.stats(), HEALTH_TIMEOUT_S)
        except (TimeoutError, ServerError):
            stats = None  # the front's own histograms are still worth a scrape
        body = self.prom.exposition(stats)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    # --- generation ------------------------------------------------------------------------

    async def _serve(self, request: Request, parse: Any) -> Response:
        try:
            self._check_key(request)
            job = parse(await _json(request), self.model)
            rid = oai.new_id(job.chat)
            if job.stream:
                streams, firsts = await self._start(job, rid)
                events = self._sse(job, rid, streams, firsts)
                return StreamingResponse(events, media_type="text/event-stream")
            dones = await self._until_done_or_gone(request, self._run(job, rid))
            return JSONResponse(oai.response(job, rid, dones))
        except OpenAIError as exc:
            return JSONResponse(exc.body(), exc.status)

    def _check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise OpenAIError(401, "Incorrect API key provided.", "authentication_error")

    async def _run(self, job: Job, rid: str) -> list[GenerateDone]:
        """Every choice to its end, at once; the first failure aborts the others."""
        ids = [f"{rid}-{i}" for i in range(job.num_choices)]
        calls = [
            self.core.generate(**job.prompt_of(i), request_id=ids[i], **job.params[i])
            for i in range(job.num_choices)
        ]
        try:
            dones = await asyncio.gather(*calls)
        except BaseException:
            self._abort(ids)
            raise
        for done in dones:
            self.prom.observe(done)
        return list(dones)

    async def _until_done_or_gone(self, request: Request, work: Any) -> list[GenerateDone]:
        """Await `work`, cancelling it (which aborts its requests) if the client goes away."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not task.done():
            task.cancel()
            raise OpenAIError(499, "the client closed the connection", code="client_closed")
        try:
            return task.result()
        except (ServerError, TimeoutError) as exc:
            raise _error_of(_as_server_error(exc)) from exc

    async def _start(self, job: Job, rid: str) -> tuple[list[AsyncStream], list[Any]]:
        """Send every choice as a streaming request and await each one's first reply, so that a
        refused request gets its HTTP status before the first byte of the stream."""
        streams: list[AsyncStream] = []
        try:
            for i in range(job.num_choices):
                stream = await self.core.generate(
                    **job.prompt_of(i), stream=True, request_id=f"{rid}-{i}", **job.params[i]
                )
                assert isinstance(stream, AsyncStream)
                streams.append(stream)
            firsts = [await _first(stream) for stream in streams]
        except (ServerError, TimeoutError) as exc:
            self._abort([s.request_id for s in streams if s.result is None])
            raise _error_of(_as_server_error(exc)) from exc
        return streams, firsts

    async def _sse(
        self, job: Job, rid: str, streams: list[AsyncStream], firsts: list[Any]
    ) -> AsyncIterator[str]:
        """SSE events: each choice's chunks as they come, its last with a finish_reason, then
        the usage chunk if asked for, then [DONE].  A closed connection aborts what is left."""
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        for i, first in enumerate(firsts):
            queue.put_nowait((i, first))
        readers = [asyncio.create_task(_pump(i, s, queue)) for i, s in enumerate(streams)]
        dones: dict[int, GenerateDone] = {}
        offsets = [0] * len(streams)
        started: set[int] = set()  # choices whose first chunk (with the chat role) went out
        calls = [CallStream() for _ in streams]  # text held while it may be a tool call
        try:
            while len(dones) < len(streams):
                index, item = await queue.get()
                if isinstance(item, ServerError):
                    yield _event(_error_of(item).body())
                    break
                if isinstance(item, GenerateDone):
                    dones[index] = item
                    self.prom.observe(item)
                    held: list[str] = []
                    called = False
                    if job.calls_tools:
                        held, called = _held_calls(job, rid, index, calls[index], started)
                    for event in held:
                        yield event
                    yield _event(oai.chunk(job, rid, index, "", [], 0, **_end(item, called)))
                    continue
                text = calls[index].feed(item.text) if job.calls_tools else item.text
                if not text and (not item.logprobs or job.calls_tools):
                    continue  # a token that ends inside a character (or may start a tool call)
                role = index not in started
                started.add(index)
                lp = item.logprobs
                yield _event(oai.chunk(job, rid, index, text, lp, offsets[index], role=role))
                offsets[index] += len(text)
            else:
                if job.include_usage:
                    ordered = [dones[i] for i in range(len(streams))]
                    yield _event(oai.usage_chunk(job, rid, ordered))
                yield "data: [DONE]\n\n"
        finally:
            for reader in readers:
                reader.cancel()
            self._abort([s.request_id for i, s in enumerate(streams) if i not in dones])

    def _abort(self, request_ids: list[str]) -> None:
        """Abort requests in the core from a task of their own: the caller may be cancelled."""
        for rid in request_ids:
            task = asyncio.get_running_loop().create_task(self._abort_one(rid))
            self.aborts.add(task)
            task.add_done_callback(self.aborts.discard)

    async def _abort_one(self, request_id: str) -> None:
        with contextlib.suppress(ServerError, TimeoutError):  # it may have ended meanwhile
            await self.core.abort(request_id)
            log.info("client gone; request aborted", request_id=request_id)


async def _first(stream: AsyncStream) -> Any:
    """A stream's first reply: a GenerateDelta, or its GenerateDone when it had none."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return stream.result


async def _pump(index: int, stream: AsyncStream, queue: asyncio.Queue) -> None:
    """Move one choice's replies into the shared queue, then its GenerateDone or its error
    (a silent core included: the stream must end, never wait for a reply that cannot come)."""
    try:
        if stream.result is None:  # its GenerateDone may have come first
            async for delta in stream:
                queue.put_nowait((index, delta))
            queue.put_nowait((index, stream.result))
    except ServerError as exc:
        queue.put_nowait((index, exc))
    except TimeoutError as exc:
        queue.put_nowait((index, ServerError("core_timeout", str(exc))))


def _held_calls(
    job: Job, rid: str, index: int, held: CallStream, started: set[int]
) -> tuple[list[str], bool]:
    """The events of a choice's held text at its end, and whether it called tools: its calls
    (each whole), or the text as content where it held none."""
    content, calls = held.finish()
    role = index not in started
    started.add(index)
    if calls:
        return [_event(oai.calls_chunk(job, rid, index, calls, role))], True
    if not content:
        return [], False
    return [_event(oai.chunk(job, rid, index, content, [], 0, role=role))], False


def _end(done: GenerateDone, called: bool = False) -> dict[str, Any]:
    if called and done.finish_reason == "stop":
        return {"finish_reason": "tool_calls"}
    return {"finish_reason": done.finish_reason}


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise oai.bad(f"the request body is not valid JSON: {exc}") from exc


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)


def _as_server_error(exc: ServerError | TimeoutError) -> ServerError:
    return exc if isinstance(exc, ServerError) else ServerError("core_timeout", str(exc))


def _error_of(exc: ServerError) -> OpenAIError:
    """The OpenAI error for an ErrorReply of the core: 400 for bad input, 503 when it cannot
    serve now, 500 otherwise."""
    if exc.code in CLIENT_ERRORS:
        return OpenAIError(400, exc.message, code=exc.code)
    if exc.code in UNAVAILABLE:
        return OpenAIError(503, exc.message, "service_unavailable", code=exc.code)
    if exc.code == "core_timeout":
        return OpenAIError(504, exc.message, "timeout", code=exc.code)
    return OpenAIError(500, exc.message, "internal_error", code=exc.code)


def build_app(front: Front) -> Starlette:
    routes = [
        Route("/v1/completions", front.completions, methods=["POST"]),
        Route("/v1/chat/completions", front.chat_completions, methods=["POST"]),
        Route("/v1/models", front.models, methods=["GET"]),
        Route("/health", front.health, methods=["GET"]),
        Route("/metrics", front.metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=front.lifespan)
    app.add_exception_handler(OpenAIError, _openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _routing_error)  # type: ignore[arg-type]
    return app


async def _openai_error(request: Request, exc: OpenAIError) -> Response:
    return JSONResponse(exc.body(), exc.status)


async def _routing_error(request: Request, exc: HTTPException) -> Response:
    """An unknown path (404) or method (405), in OpenAI's error object as every other error."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    error = OpenAIError(exc.status_code, message, kind, code=exc.status_code)
    return JSONResponse(error.body(), exc.status_code, headers=exc.headers)


# --- the process ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memstep.api.http_server", description=__doc__)
    p.add_argument("--zmq", required=True, help="the core's ZMQ API address")
    p.add_argument("--model-name", required=True, help="the model name /v1/models lists")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    p.add_argument("--fd", type=int, help="serve on this inherited listening socket instead")
    p.add_argument("--ready-fd", type=int, help="write a line to this pipe once serving")
    p.add_argument(
        "--core-timeout",
        type=float,
        default=CORE_TIMEOUT_S,
        help="seconds of silence from the core before a request fails with 504 "
        "(default: %(default)s)",
    )
    p.add_argument("--log-level", default="warning", help="default: %(default)s")
    p.add_argument("--log-format", choices=["console", "json"], default="console")
    args = p.parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    api_key = os.environ.pop("MEMSTEP_API_KEY", None) or None  # not on the command line
    front = Front(args.zmq, args.model_name, api_key, _curve_from_env())
    front.ready_fd = args.ready_fd
    front.core_timeout = args.core_timeout
    sock = socket.socket(fileno=args.fd) if args.fd is not None else None
    config = uvicorn.Config(
        build_app(front),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
    )
    _watch_parent()
    uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)
    return 0


def _curve_from_env() -> dict[str, str]:
    """CURVE keys for the ZMQ link: "server public secret" (z85) in MEMSTEP_FRONT_CURVE."""
    text = os.environ.pop("MEMSTEP_FRONT_CURVE", "")
    if not text:
        return {}
    server, public, secret = text.split()
    return {"curve_server_key": server, "curve_public_key": public, "curve_secret_key": secret}


def _watch_parent() -> None:
    """Exit when the process that started us (memstep serve) is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


if __name__ == "__main__":
    sys.exit(main())
