"""The OpenAI-compatible HTTP front: its own process, a ZMQ client of the core like any other.

    python -m memstep.serving.http_front.http_server --zmq tcp://127.0.0.1:5557 --port 8000

`memstep serve` starts it (see `serving/http_front/http_front.py`).  Endpoints:
`POST /v1/completions`, `POST /v1/chat/completions` (SSE with `stream: true`), `GET /v1/models`,
`POST /tokenize` and `POST /detokenize` (vLLM's), `GET /health` (200 only while the core says
"ok"), `GET /metrics`.  Every request goes through `AsyncClient`: one codec, one path into the
engine, and no torch in this process.  A client that disconnects aborts its requests in the core.
With an API key, `/v1/*` and the token endpoints need `Authorization: Bearer KEY`.

No request shares fate with another: its size, its connection and its time are bounded
(`serving/http_front/http_limits.py`, docs/limits.md); a request the core cannot take (over its
frame limit, not encodable) fails here with a 4xx; a request whose link to the core is lost
(`route_lost`) ends with an error (an SSE error event, then `[DONE]`); and the front's own figures
(resident memory, open connections, requests in flight, its client's entries) are in `/metrics`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import resource
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from memstep.api.client import AsyncClient, AsyncStream, ServerError
from memstep.api.client import error_of as reply_error
from memstep.core import collector
from memstep.core.logging import setup_logging
from memstep.events.wire import ErrorReply, GenerateDone, HealthReply, TokenizeRequest
from memstep.serving.http_front import openai_protocol as oai
from memstep.serving.http_front import tool_parsers
from memstep.serving.http_front.http_errors import as_server_error, error_of, error_response
from memstep.serving.http_front.http_limits import (
    GuardedHttptools,
    HttpLimits,
    guarded_protocol,
    limit_log_rate,
    read_body,
)
from memstep.serving.http_front.metrics import FrontStats, Metrics
from memstep.serving.http_front.openai_protocol import Job, OpenAIError
from memstep.serving.http_front.sse import SseResponse
from memstep.serving.tally import host_rss_bytes

log = structlog.get_logger("memstep.http")

HEALTH_TIMEOUT_S = 2.0
CORE_TIMEOUT_S = 600.0  # a request's silence before it fails: one step may be long on a busy CPU


class Front:
    """Owns the ZMQ client of the core, the model's name and the metrics; answers HTTP."""

    def __init__(
        self,
        address: str,
        model: str,
        api_key: str | None,
        curve: dict[str, str],
        limits: HttpLimits | None = None,
    ):
        self.address = address
        self.model = model
        self.api_key = api_key
        self.curve = curve
        self.limits = limits or HttpLimits()
        self.client: AsyncClient | None = None
        self.ready_fd: int | None = None  # written to once serving
        self.core_timeout = CORE_TIMEOUT_S
        self.core_frame_bytes: int | None = None  # the core's max_frame_bytes, when told
        self.tool_format = tool_parsers.DEFAULT_FORMAT  # how the model's tool calls read
        self.created = int(time.time())
        self.prom = Metrics()
        self.num_inflight = 0  # generation requests before their response starts
        self.streaming: set[str] = set()  # SSE responses under way
        self.connections: set[Any] = set()  # uvicorn's open connections, once it serves
        self.aborts: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.client = AsyncClient(
            self.address,
            timeout=self.core_timeout,
            max_frame_bytes=self.core_frame_bytes,
            **self.curve,  # type: ignore[arg-type]
        )
        if self.core_frame_bytes is None:  # ask the core, without waiting for it here
            self.aborts.add(asyncio.create_task(self._learn_frame_limit()))
        log.info("http front ready", core=self.address, model=self.model)
        if self.ready_fd is not None:
            os.write(self.ready_fd, b"ready\n")
            os.close(self.ready_fd)
        try:
            yield
        finally:
            await self.client.close()

    async def _learn_frame_limit(self) -> None:
        """The core's frame limit, so that a larger request fails here instead of there (a
        frame past its hard limit would close the link every request in flight shares)."""
        while self.core.max_frame_bytes is None:
            with contextlib.suppress(TimeoutError, ServerError, ConnectionError):
                reply = await asyncio.wait_for(self.core.health(), HEALTH_TIMEOUT_S)
                self.core.max_frame_bytes = reply.max_frame_bytes
            await asyncio.sleep(0.5)

    @property
    def core(self) -> AsyncClient:
        assert self.client is not None, "the front is not started"
        return self.client

    # --- endpoints -------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, oai.parse_completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, self._parse_chat)

    def _parse_chat(self, body: Any, model: str) -> oai.Job:
        return oai.parse_chat(body, model, self.tool_format)

    async def tokenize(self, request: Request) -> Response:
        return await self._tokens(request, oai.parse_tokenize, oai.tokenized)

    async def detokenize(self, request: Request) -> Response:
        return await self._tokens(request, oai.parse_detokenize, oai.detokenized)

    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's `/tokenizer_info`: the tokenizer's config (its class, special tokens, chat
        template, model_max_length), from which a client such as lm-eval (its `remote`
        tokenizer) reads the end-of-text token and the template."""
        return await self._tokens(request, None, oai.tokenizer_info)

    async def _tokens(self, request: Request, parse: Any, answer: Any) -> Response:
        """vLLM's /tokenize and /detokenize: one TokenizeRequest to the core, within the
        request's deadline."""
        deadline = asyncio.get_running_loop().time() + self.limits.request_timeout_s
        try:
            self._check_key(request)
            if parse is None:
                msg = TokenizeRequest("", tokenizer_info=True)
            else:
                msg = parse(_json(await read_body(request, self.limits)), self.model)
            try:
                reply = await self._within(deadline, self.core.tokenize(msg))
            except (ServerError, TimeoutError, ConnectionError) as exc:
                raise error_of(as_server_error(exc)) from None
            return JSONResponse(answer(reply))
        except OpenAIError as exc:
            return error_response(exc)

    async def models(self, request: Request) -> Response:
        self._check_key(request)
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model_card(self, request: Request) -> Response:
        """`GET /v1/models/{id}`: the served model's card; any other id is OpenAI's 404."""
        self._check_key(request)
        name = request.path_params["name"]
        if name != self.model:
            message = f"The model `{name}` does not exist."
            return error_response(OpenAIError(404, message, param="model", code="model_not_found"))
        return JSONResponse(self._card())

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "memstep",
            "root": self.model,
        }

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
        body = self.prom.exposition(stats, self._own_stats())
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    def _own_stats(self) -> FrontStats:
        return FrontStats(
            rss_bytes=host_rss_bytes({"front": os.getpid()}).get("front", 0),
            num_connections=len(self.connections),
            num_inflight=self.num_inflight + len(self.streaming),
            num_client_entries=self.client.num_pending if self.client is not None else 0,
            num_refused_connections=GuardedHttptools.refused,
            num_timed_out_connections=GuardedHttptools.timed_out,
        )

    # --- generation ------------------------------------------------------------------------

    async def _serve(self, request: Request, parse: Any) -> Response:
        """A completion; `X-Request-Id` (the client's id, as vLLM takes it) names the HTTP id
        (`cmpl-<id>`) and comes back as a header; in the core its choices are `cmpl-<id>.<tag>-<i>`
        (`_core_id`), so two requests in flight with one id do not collide. Every request has a
        deadline (`--request-timeout`)."""
        given = request.headers.get("x-request-id")
        header: dict[str, str] = {}
        self.num_inflight += 1
        deadline = asyncio.get_running_loop().time() + self.limits.request_timeout_s
        try:
            self._check_key(request)
            xid = _client_id(given)
            header = {"X-Request-Id": xid} if xid else {}
            job = parse(_json(await read_body(request, self.limits)), self.model)
            rid = oai.new_id(job.chat, xid)
            header = {"X-Request-Id": xid or rid}
            cid = _core_id(rid, xid)
            for i in range(job.num_choices):
                log.info("request arrived", request_id=f"{cid}-{i}", http_id=rid, x_request_id=xid)
            if job.stream:
                counted = await self._within(deadline, self._prompt_tokens(job))
                streams, firsts = await self._within(deadline, self._start(job, cid))
                self.streaming.add(cid)
                out = SseResponse(job, rid, len(streams), prompt_tokens=counted)
                events = self._sse(out, cid, streams, firsts, deadline)
                # the background task ends the streams also when the body never started
                end = BackgroundTask(self._end_streams, cid, streams)
                return StreamingResponse(
                    events, media_type="text/event-stream", headers=header, background=end
                )
            work = self._within(deadline, self._run(job, cid))
            dones = await self._until_done_or_gone(request, work)
            return JSONResponse(oai.response(job, rid, dones), headers=header)
        except OpenAIError as exc:
            log.info("request rejected", x_request_id=given, status=exc.status, reason=str(exc))
            return error_response(exc, header)
        finally:
            self.num_inflight -= 1

    async def _prompt_tokens(self, job: Job) -> list[int]:
        """Each prompt's length in tokens, where every chunk carries usage (vLLM's
        continuous_usage_stats): the core tokenizes it as the request will be."""
        if not job.continuous_usage:
            return []
        counts = []
        for source in job.prompts:
            if isinstance(source.get("prompt"), list):
                counts.append(len(source["prompt"]))
                continue
            try:
                reply = await self.core.tokenize(TokenizeRequest("", **source))
            except (ServerError, TimeoutError, ConnectionError) as exc:
                raise error_of(as_server_error(exc)) from None
            counts.append(len(reply.token_ids))
        return counts

    async def _end_streams(self, cid: str, streams: list[AsyncStream]) -> None:
        self._end_streams_now(cid, streams)

    def _end_streams_now(self, cid: str, streams: list[AsyncStream]) -> None:
        """Abort and forget the choices that did not end; safe to call twice."""
        self.streaming.discard(cid)
        unfinished = [s.request_id for s in streams if self.core.is_pending(s.request_id)]
        self._abort(unfinished)
        for request_id in unfinished:
            self.core.forget(request_id)

    async def _within(self, deadline: float, work: Any) -> Any:
        """`work` awaited until the request's deadline; then a core_timeout (504)."""
        left = deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(work, max(left, 0.0))
        except TimeoutError:
            message = f"the request passed its deadline of {self.limits.request_timeout_s} s"
            raise ServerError("core_timeout", message) from None

    def _check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self.api_key.encode()
        )
        if not ok:
            raise OpenAIError(401, "Incorrect API key provided.", "authentication_error")

    async def _run(self, job: Job, cid: str) -> list[GenerateDone]:
        """Every choice to its end, at once; the first failure aborts the others."""
        ids = [f"{cid}-{i}" for i in range(job.num_choices)]
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
        except (ServerError, TimeoutError, ConnectionError) as exc:
            raise error_of(as_server_error(exc)) from exc

    async def _start(self, job: Job, cid: str) -> tuple[list[AsyncStream], list[Any]]:
        """Send every choice as a streaming request and await each one's first reply, so that a
        refused request gets its HTTP status before the first byte of the stream."""
        streams: list[AsyncStream] = []
        try:
            for i in range(job.num_choices):
                stream = await self.core.generate(
                    **job.prompt_of(i), stream=True, request_id=f"{cid}-{i}", **job.params[i]
                )
                assert isinstance(stream, AsyncStream)
                streams.append(stream)
            firsts = [await _first(stream) for stream in streams]
        except BaseException as exc:
            self._abort([s.request_id for s in streams if s.result is None])
            for stream in streams:
                self.core.forget(stream.request_id)
            if isinstance(exc, ServerError | TimeoutError | ConnectionError):
                raise error_of(as_server_error(exc)) from exc
            raise
        return streams, firsts

    async def _sse(
        self,
        out: SseResponse,
        cid: str,  # the core's id
        streams: list[AsyncStream],
        firsts: list[Any],
        deadline: float,
    ) -> AsyncIterator[bytes]:
        """SSE events: each choice's chunks as they come, its last with a finish_reason, then
        the usage chunk if asked for, then [DONE]; an error (the deadline included) is an error
        event, then [DONE]. Every choice's replies come into one queue (`AsyncClient.share`),
        and those that arrived while the last write went out leave in one write (a stream behind
        by several steps catches up in one). A closed connection aborts what is left."""
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        for i, (first, stream) in enumerate(zip(firsts, streams, strict=True)):
            queue.put_nowait((i, first))
            self.core.share(stream.request_id, queue, i)
        alarm = asyncio.create_task(_alarm(deadline, queue, self.core))
        try:
            if out.job.chat:  # each choice's role first, before any token
                yield b"".join(out.role_events())
            while not out.ended:
                items = [await self.core.take(queue)]
                while not queue.empty():  # all that came meanwhile, in one write
                    items.append(queue.get_nowait())
                out.created = int(time.time())
                data = b"".join([out.events(i, self._ended(streams[i], r)) for i, r in items])
                if data:
                    yield data
        finally:
            alarm.cancel()
            self._end_streams_now(cid, streams)

    def _ended(self, stream: AsyncStream, reply: Any) -> Any:
        """A reply, its request forgotten (and its figures observed) once it ends the request;
        an ErrorReply as the error it raises."""
        if isinstance(reply, GenerateDone | ErrorReply):
            self.core.forget(stream.request_id)
        if isinstance(reply, GenerateDone):
            self.prom.observe(reply)
        return reply_error(reply) if isinstance(reply, ErrorReply) else reply

    def _abort(self, request_ids: list[str]) -> None:
        """Abort requests in the core from a task of their own: the caller may be cancelled."""
        for rid in request_ids:
            task = asyncio.get_running_loop().create_task(self._abort_one(rid))
            self.aborts.add(task)
            task.add_done_callback(self.aborts.discard)

    async def _abort_one(self, request_id: str) -> None:
        with contextlib.suppress(ServerError, TimeoutError, ConnectionError):  # it may have ended
            await self.core.abort(request_id)
            log.info("client gone; request aborted", request_id=request_id)


async def _first(stream: AsyncStream) -> Any:
    """A stream's first reply: a GenerateDelta, or its GenerateDone when it had none."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return stream.result


def _core_id(rid: str, client_id: str | None) -> str:
    """The id of the request's choices in the core: the response's id, tagged when the client
    named it, since a client may send one `X-Request-Id` twice at once (vLLM echoes it, too, and
    keeps its own ids unique)."""
    return rid if client_id is None else f"{rid}.{uuid.uuid4().hex[:8]}"


def _client_id(given: str | None) -> str | None:
    """The client's `X-Request-Id`: up to 128 printable ASCII characters, no spaces."""
    if given is None:
        return None
    if not 0 < len(given) <= 128 or not all("!" <= c <= "~" for c in given):
        raise oai.bad("X-Request-Id must be 1 to 128 printable ASCII characters without spaces")
    return given


async def _alarm(deadline: float, queue: asyncio.Queue, core: AsyncClient) -> None:
    """At the request's deadline, or once the core said nothing for its timeout, an error into
    the response's queue (one timer for all its choices, instead of one per reply awaited); it
    ends the whole response, whichever choice it names."""
    loop = asyncio.get_running_loop()
    while (wake := min(deadline, core.heard + core.timeout)) > loop.time():
        await asyncio.sleep(wake - loop.time())
    if loop.time() >= deadline:
        error = ServerError("core_timeout", "the request passed its deadline")
    else:
        error = ServerError("core_timeout", f"no word from {core.address} for {core.timeout} s")
    queue.put_nowait((0, error))


def _json(body: bytes) -> Any:
    """The parsed body; 400 for anything that is not JSON a request can hold (nested past
    Python's recursion limit, or an integer past its 4,300 digits, included)."""
    try:
        return json.loads(body)
    except ValueError as exc:  # not JSON, not UTF-8, an integer too long to convert
        raise oai.bad(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise oai.bad("the request body is nested too deeply") from None


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)


def build_app(front: Front) -> Starlette:
    routes = [
        Route("/v1/completions", front.completions, methods=["POST"]),
        Route("/v1/chat/completions", front.chat_completions, methods=["POST"]),
        Route("/v1/models", front.models, methods=["GET"]),
        Route("/v1/models/{name:path}", front.model_card, methods=["GET"]),
        Route("/tokenize", front.tokenize, methods=["POST"]),
        Route("/detokenize", front.detokenize, methods=["POST"]),
        Route("/tokenizer_info", front.tokenizer_info, methods=["GET"]),
        Route("/health", front.health, methods=["GET"]),
        Route("/metrics", front.metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=front.lifespan)
    app.add_exception_handler(OpenAIError, _openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _routing_error)  # type: ignore[arg-type]
    return app


async def _openai_error(request: Request, exc: OpenAIError) -> Response:
    return error_response(exc)


async def _routing_error(request: Request, exc: HTTPException) -> Response:
    """An unknown path (404) or method (405), in OpenAI's error object as every other error."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    error = OpenAIError(exc.status_code, message, kind, code=exc.status_code)
    return JSONResponse(error.body(), exc.status_code, headers=exc.headers)


# --- the process ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m memstep.serving.http_front.http_server", description=__doc__
    )
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
    p.add_argument("--core-max-frame-bytes", type=int, help="the core's --max-frame-bytes")
    p.add_argument("--tool-call-parser", default=tool_parsers.DEFAULT.name, help="the format")
    p.add_argument("--tools-in-template", action="store_true", help="the template writes tools")
    p.add_argument("--no-system-turn", action="store_true", help="the template takes none")
    p.add_argument("--log-level", default="warning", help="default: %(default)s")
    p.add_argument("--log-format", choices=["console", "json"], default="console")
    for field in attrs.fields(HttpLimits):  # see docs/limits.md
        p.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default))
    args = p.parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    collector.tune_for_core()  # a step's chunks are as many short-lived objects as the core's
    given = {f.name: getattr(args, f.name) for f in attrs.fields(HttpLimits)}
    limits = HttpLimits(**{name: value for name, value in given.items() if value is not None})
    api_key = os.environ.pop("MEMSTEP_API_KEY", None) or None  # not on the command line
    front = Front(args.zmq, args.model_name, api_key, _curve_from_env(), limits)
    front.ready_fd = args.ready_fd
    front.core_timeout = args.core_timeout
    front.core_frame_bytes = args.core_max_frame_bytes
    parser = tool_parsers.parser_named(args.tool_call_parser)
    system_turn = not args.no_system_turn
    front.tool_format = tool_parsers.ToolFormat(parser, args.tools_in_template, system_turn)
    sock = socket.socket(fileno=args.fd) if args.fd is not None else None
    config = uvicorn.Config(
        build_app(front),
        host=args.host,
        port=args.port,
        http=guarded_protocol(limits),
        log_level="warning",
        access_log=False,
        timeout_keep_alive=int(max(1, limits.keepalive_timeout_s)),
        timeout_graceful_shutdown=2,
        backlog=4096,
    )
    _raise_open_files(limits.max_connections + 256)
    limit_log_rate(limits.log_lines_per_s)
    _watch_parent()
    server = uvicorn.Server(config)
    front.connections = server.server_state.connections
    server.run(sockets=[sock] if sock is not None else None)
    return 0


def _raise_open_files(wanted: int) -> None:
    """Allow `wanted` open files (a socket each), up to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


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
