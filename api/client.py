"""Clients of the memstep API: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("tcp://127.0.0.1:5557") as client:
        done = client.generate("The capital of France is", max_tokens=8)
        print(done.text, done.finish_reason, done.timing.ttft_s)
        for delta in client.generate(messages=[{"role": "user", "content": "Hi"}], stream=True):
            print(delta.text, end="")

Replies are the records of `events/wire.py`: `GenerateDone` (text, token_ids, finish_reason,
usage, timing), `GenerateDelta` (token_ids, text), `HealthReply`, `StatsReply`.  An ErrorReply
raises `ServerError` with its code (`Overloaded`, a subclass, for `overloaded`); `timeout`
seconds without a word from the server (it sends a Keepalive every second while a request is in
flight) raise `TimeoutError`.  `Client` raises
`ConnectionError` after `connect_timeout` seconds when nothing accepts its connection at all;
both clients raise it when no connection takes a request within `timeout` (a CURVE server that
refused this client's key drops its connection).
Each client is one DEALER socket and may have many requests in flight.  `AsyncClient` keeps an
entry per request in flight and removes it on every way out (its end, an error, a cancelled
await, `forget`); when its connection to the server closes (ZeroMQ reconnects, but the server
has dropped every request of the closed one), each request in flight fails with `route_lost`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

import attrs
import structlog
import zmq
import zmq.asyncio

from memstep.events import codec
from memstep.events.wire import (
    OVERLOADED,
    AbortReply,
    AbortRequest,
    AttachRequest,
    ErrorReply,
    GenerateDelta,
    GenerateDeltas,
    GenerateDone,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    StatsReply,
    StatsRequest,
    TokenizeReply,
    TokenizeRequest,
)

log = structlog.get_logger("memstep.client")

T = TypeVar("T")

DEFAULT_ADDRESS = "tcp://127.0.0.1:5557"
ROUTE_LOST = "route_lost"
CONNECT_TIMEOUT_S = 3.0
MAX_FRAMES_PER_READ = 256  # frames the async reader takes at once before others may run


class ServerError(RuntimeError):
    """The server answered a request with an ErrorReply."""

    def __init__(self, code: str, message: str, request_id: str = ""):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class Overloaded(ServerError):
    """The server refused a new request: `--max-waiting-requests` others already wait.  Nothing
    of it ran; send it again later (over HTTP: 503 with Retry-After)."""


ERRORS: dict[str, type[ServerError]] = {OVERLOADED: Overloaded}


Key = bytes | str  # a z85 CURVE key, 40 characters


def _connect(
    sock: zmq.Socket, address: str, server: Key | None, public: Key | None, secret: Key | None
) -> None:
    """Connect `sock`; with the server's public key, as a CURVE client with its own key pair."""
    sock.setsockopt(zmq.LINGER, 0)
    if server:
        if not (public and secret):
            raise ValueError("a CURVE client needs curve_public_key and curve_secret_key")
        sock.setsockopt(zmq.CURVE_SERVERKEY, _bytes(server))
        sock.setsockopt(zmq.CURVE_PUBLICKEY, _bytes(public))
        sock.setsockopt(zmq.CURVE_SECRETKEY, _bytes(secret))
    sock.connect(address)


def _unsent(address: str, timeout: float) -> str:
    return (
        f"no connection to {address} took the request in {timeout} s "
        f"(the server refused this client, or it is gone)"
    )


def _frame_of(msg: Any, max_bytes: int | None) -> bytes:
    """The encoded request; ServerError (with its id) when it cannot be encoded or is over
    `max_bytes`: sent, a frame past the server's hard limit would close the connection."""
    try:
        frame = codec.encode(msg)
    except codec.CodecError as exc:
        raise ServerError("invalid_request", str(exc), msg.request_id) from None
    if max_bytes is not None and len(frame) > max_bytes:
        message = f"request of {len(frame)} bytes > the server's limit of {max_bytes}"
        raise ServerError("frame_too_large", message, msg.request_id)
    return frame


def _bytes(key: Key) -> bytes:
    return key.encode() if isinstance(key, str) else key


def generate_request(
    request_id: str,
    prompt: str | list[int] | None,
    messages: list[dict[str, str]] | None,
    stream: bool,
    params: dict[str, Any],
    special_tokens_in_messages: bool = False,
    batch_deltas: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
) -> GenerateRequest:
    """A GenerateRequest from the arguments of `generate`; a list prompt is token ids."""
    text, ids = (None, prompt) if isinstance(prompt, list) else (prompt, None)
    special, extra = special_tokens_in_messages, chat_template_kwargs or {}
    return GenerateRequest(
        request_id,
        text,
        ids,
        messages,
        params,
        stream,
        special,
        batch_deltas=batch_deltas,
        chat_template_kwargs=extra,
        add_special_tokens=add_special_tokens,
    )


def _addressed(msg: object) -> list[tuple[str, object]]:
    """(request id, reply) of each reply a frame holds: a GenerateDeltas holds several."""
    if isinstance(msg, GenerateDeltas):  # the type checker narrows on isinstance
        return [(delta.request_id, delta) for delta in msg.deltas]
    return [(_addressee(msg) or "", msg)]


def _addressee(msg: object) -> str | None:
    """The request a reply belongs to; None for a Keepalive (or anything without one)."""
    rid = getattr(msg, "request_id", None)
    return rid if isinstance(rid, str) else None


def _final(msg: object) -> object:
    if isinstance(msg, ErrorReply):
        raise error_of(msg)
    return msg


def error_of(reply: ErrorReply) -> ServerError:
    """The exception an ErrorReply raises."""
    return ERRORS.get(reply.code, ServerError)(reply.code, reply.message, reply.request_id)


def _expect(reply: object, expect: type[Any]) -> Any:
    if not isinstance(reply, expect):
        raise ServerError("protocol", f"expected {expect.__name__}, got {type(reply).__name__}")
    return reply


class _Replies:
    """The replies of one generate request, in order: deltas, then its GenerateDone."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.result: GenerateDone | None = None

    def _take(self, msg: object) -> GenerateDelta | None:
        """A delta to hand out, or None once `msg` is the GenerateDone (kept as `result`)."""
        if isinstance(msg, GenerateDone):
            self.result = msg
            return None
        assert isinstance(msg, GenerateDelta), type(msg).__name__
        return msg


# --- blocking ------------------------------------------------------------------------------


class Client:
    """A blocking client.  Not thread-safe: use one per thread (they are cheap)."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float = 60.0,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        curve_server_key: Key | None = None,
        curve_public_key: Key | None = None,
        curve_secret_key: Key | None = None,
    ):
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._monitor: zmq.Socket | None = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        self._born = time.monotonic()
        # a DEALER holds a message until a connection takes it: with none (a server that
        # refused this client's CURVE key drops it), an unbounded send would wait forever
        self._sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        _connect(self._sock, address, curve_server_key, curve_public_key, curve_secret_key)
        self._ids = itertools.count()
        self._pending: dict[str, collections.deque[object]] = {}

    def generate(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        stream: bool = False,
        request_id: str | None = None,
        special_tokens_in_messages: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
        **params: Any,
    ) -> GenerateDone | Stream:
        """Text prompt, token ids or chat `messages`; `params` are SamplingParams fields.

        `special_tokens_in_messages` reads "<|im_start|>" in a message as the control token;
        `chat_template_kwargs` are more variables for the chat template; `add_special_tokens`
        adds the tokenizer's own special tokens (a BOS, say) around a text's or a chat's ids.
        """
        rid = request_id or self._new_id()
        special = special_tokens_in_messages
        extra, added = chat_template_kwargs, add_special_tokens
        msg = generate_request(rid, prompt, messages, stream, params, special, False, extra, added)
        self._send(msg)
        if stream:
            return Stream(self, rid)
        while not isinstance(msg := self._next(rid), GenerateDone):
            pass
        self._pending.pop(rid, None)
        return msg

    def attach(
        self, request_id: str, from_index: int = 0, stream: bool = True
    ) -> GenerateDone | Stream:
        """The rest of a request that a server which died was answering, from a server resumed
        from its log (`serve --resume`): output tokens from `from_index` on."""
        self._send(AttachRequest(request_id, from_index, stream))
        if stream:
            return Stream(self, request_id)
        while not isinstance(msg := self._next(request_id), GenerateDone):
            pass
        self._pending.pop(request_id, None)
        return msg

    def abort(self, request_id: str) -> None:
        """Abort a request of this client; its stream ends with finish_reason "abort"."""
        self._call(AbortRequest(self._new_id(), request_id), AbortReply)

    def health(self) -> HealthReply:
        return self._call(HealthRequest(self._new_id()), HealthReply)

    def stats(self) -> StatsReply:
        return self._call(StatsRequest(self._new_id()), StatsReply)

    def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        special_tokens_in_messages: bool = False,
    ) -> TokenizeReply:
        """The token ids the server reads `prompt` (raw) or chat `messages` as."""
        msg = TokenizeRequest(self._new_id(), prompt, messages, None, special_tokens_in_messages)
        return self._call(msg, TokenizeReply)

    def detokenize(self, token_ids: list[int]) -> str:
        msg = TokenizeRequest(self._new_id(), token_ids=list(token_ids))
        return self._call(msg, TokenizeReply).text

    def close(self) -> None:
        self._forget_monitor()
        self._sock.close(0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _new_id(self) -> str:
        return f"c{next(self._ids)}"

    def _send(self, msg: Any) -> None:
        frame = _frame_of(msg, None)
        self._pending[msg.request_id] = collections.deque()
        try:
            self._sock.send(frame)
        except zmq.Again:
            self._pending.pop(msg.request_id, None)
            raise ConnectionError(_unsent(self.address, self.timeout)) from None

    def _call(self, msg: Any, expect: type[Any]) -> Any:
        self._send(msg)
        reply = self._next(msg.request_id)
        self._pending.pop(msg.request_id, None)
        return _expect(reply, expect)

    def _next(self, request_id: str) -> object:
        """The next reply to `request_id`, buffering replies to others meanwhile."""
        queue = self._pending.setdefault(request_id, collections.deque())
        while not queue:
            if not self._poll():
                raise TimeoutError(f"no word from {self.address} for {self.timeout} s")
            for rid, msg in _addressed(codec.decode(self._sock.recv())):
                waiting = self._pending.get(rid)  # None for a Keepalive
                if waiting is not None:
                    waiting.append(msg)
        msg = queue.popleft()
        if isinstance(msg, ErrorReply):
            self._pending.pop(request_id, None)
        return _final(msg)

    def _poll(self) -> bool:
        """Wait for a reply up to `timeout`; until connected, also at most `connect_timeout`
        since the client was made, then ConnectionError: nothing listens there."""
        deadline = time.monotonic() + self.timeout
        while self._monitor is not None:
            if self._monitor.poll(0):
                self._forget_monitor()  # connected: from now on only `timeout` counts
                break
            if time.monotonic() - self._born > self.connect_timeout:
                raise ConnectionError(
                    f"nothing accepts connections at {self.address} "
                    f"(is `memstep serve` running there?)"
                )
            if self._sock.poll(50):
                return True
            if time.monotonic() > deadline:
                return False
        return bool(self._sock.poll(max(0, int((deadline - time.monotonic()) * 1000))))

    def _forget_monitor(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._monitor = None


class Stream(_Replies):
    """Iterates the GenerateDelta replies of one request; then `result` is its GenerateDone."""

    def __init__(self, client: Client, request_id: str):
        super().__init__(request_id)
        self.client = client

    def __iter__(self) -> Iterator[GenerateDelta]:
        return self

    def __next__(self) -> GenerateDelta:
        if self.result is not None:
            raise StopIteration
        delta = self._take(self.client._next(self.request_id))
        if delta is None:
            self.client._pending.pop(self.request_id, None)
            raise StopIteration
        return delta

    def close(self) -> None:
        """Abort the request if it is still running, and read to its end."""
        if self.result is None:
            with contextlib.suppress(ServerError):  # it may have finished meanwhile
                self.client.abort(self.request_id)
            for _ in self:
                pass

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- asyncio -------------------------------------------------------------------------------


class AsyncClient:
    """An asyncio client; a reader task routes replies to the requests awaiting them."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float = 60.0,
        curve_server_key: Key | None = None,
        curve_public_key: Key | None = None,
        curve_secret_key: Key | None = None,
        context: zmq.asyncio.Context | None = None,
        max_frame_bytes: int | None = None,
    ):
        self.address = address
        self.timeout = timeout
        self.max_frame_bytes = max_frame_bytes  # larger requests fail here, never sent
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        # the same socket, read without awaiting: what has come already
        self._now: zmq.Socket = zmq.Socket.shadow(self._sock.underlying)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        _connect(self._sock, address, curve_server_key, curve_public_key, curve_secret_key)
        self._ids = itertools.count()
        self._queues: dict[str, asyncio.Queue[object] | _Shared] = {}
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._heard = 0.0

    async def generate(
        self,
        prompt: str | list[int] | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        stream: bool = False,
        request_id: str | None = None,
        special_tokens_in_messages: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
        **params: Any,
    ) -> GenerateDone | AsyncStream:
        """As `Client.generate`; with `stream=True` an async iterator of GenerateDelta (taken
        from the server in one GenerateDeltas a step with this client's other streams)."""
        rid = request_id or self._new_id()
        special, extra = special_tokens_in_messages, chat_template_kwargs
        added = add_special_tokens
        msg = generate_request(rid, prompt, messages, stream, params, special, stream, extra, added)
        await self._send(msg)
        if stream:
            return AsyncStream(self, rid)
        try:
            while not isinstance(msg := await self._next(rid), GenerateDone):
                pass
        finally:  # also when the caller gives up waiting (wait_for, cancel)
            self._queues.pop(rid, None)
        return msg

    async def attach(
        self, request_id: str, from_index: int = 0, stream: bool = True
    ) -> GenerateDone | AsyncStream:
        """As `Client.attach`."""
        await self._send(AttachRequest(request_id, from_index, stream))
        if stream:
            return AsyncStream(self, request_id)
        while not isinstance(msg := await self._next(request_id), GenerateDone):
            pass
        self._queues.pop(request_id, None)
        return msg

    async def abort(self, request_id: str) -> None:
        await self._call(AbortRequest(self._new_id(), request_id), AbortReply)

    async def health(self) -> HealthReply:
        return await self._call(HealthRequest(self._new_id()), HealthReply)

    async def stats(self) -> StatsReply:
        return await self._call(StatsRequest(self._new_id()), StatsReply)

    async def tokenize(self, request: TokenizeRequest) -> TokenizeReply:
        """`request` (its request_id replaced by this client's own) answered."""
        return await self._call(attrs.evolve(request, request_id=self._new_id()), TokenizeReply)

    def share(self, request_id: str, queue: asyncio.Queue[tuple[int, object]], tag: int) -> None:
        """Put the replies of `request_id` (those here already, then those to come) into
        `queue` as `(tag, reply)`, for a caller that reads several requests' replies from one
        queue (`take`) instead of a stream each: one task wakes for a step's replies, not one a
        request.  The caller `forget`s the request at its GenerateDone or ErrorReply."""
        own = self._queues.get(request_id)
        if not isinstance(own, asyncio.Queue):
            return
        shared = _Shared(queue, tag)
        while not own.empty():
            shared.put_nowait(own.get_nowait())
        self._queues[request_id] = shared

    async def take(self, queue: asyncio.Queue[T]) -> T:
        """The next item of a queue that `share` fills.  No timer is armed per wait: the
        caller watches the server's silence (`heard`) once for all the queue's requests."""
        if self._reader is not None and self._reader.done():
            self._reader.result()  # re-raise what ended the reader
        return queue.get_nowait() if not queue.empty() else await queue.get()

    @property
    def heard(self) -> float:
        """The event loop's time of the last frame from the server (or of the first send)."""
        return self._heard

    def forget(self, request_id: str) -> None:
        """Drop the entry of a request whose replies nobody will read (a stream its reader
        left); replies that still come for it are discarded."""
        self._queues.pop(request_id, None)

    def is_pending(self, request_id: str) -> bool:
        """Whether `request_id` has an entry: sent, and neither ended nor forgotten."""
        return request_id in self._queues

    @property
    def num_pending(self) -> int:
        """Requests with an entry here: in flight, or not yet read to their end."""
        return len(self._queues)

    async def close(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _new_id(self) -> str:
        return f"a{next(self._ids)}"

    async def _send(self, msg: Any) -> None:
        """Encode and send `msg`; a request that cannot be encoded or is over the server's
        frame limit raises ServerError before it leaves an entry."""
        if self._reader is None:
            self._heard = asyncio.get_running_loop().time()
            self._reader = asyncio.create_task(self._read())
            self._watcher = asyncio.create_task(self._watch())
        frame = _frame_of(msg, self.max_frame_bytes)
        self._queues[msg.request_id] = asyncio.Queue()
        try:
            await asyncio.wait_for(self._sock.send(frame), self.timeout)
        except BaseException as exc:
            self._queues.pop(msg.request_id, None)
            if isinstance(exc, TimeoutError):
                raise ConnectionError(_unsent(self.address, self.timeout)) from None
            raise

    async def _call(self, msg: Any, expect: type[Any]) -> Any:
        await self._send(msg)
        try:
            reply = await self._next(msg.request_id)
        finally:  # also when the caller gives up waiting (wait_for, cancel)
            self._queues.pop(msg.request_id, None)
        return _expect(reply, expect)

    async def _read(self) -> None:
        """Route every reply to its request's queue: one awaited frame, then, without awaiting,
        those that came with it (an await per frame costs more than the frame's decoding)."""
        loop = asyncio.get_running_loop()
        while True:
            frames = [await self._sock.recv()]
            with contextlib.suppress(zmq.Again):
                while len(frames) < MAX_FRAMES_PER_READ:
                    frames.append(self._now.recv(zmq.NOBLOCK))
            self._heard = loop.time()
            for frame in frames:
                for rid, msg in _addressed(codec.decode(frame)):
                    queue = self._queues.get(rid)
                    if queue is not None:
                        queue.put_nowait(msg)

    async def _watch(self) -> None:
        """On each closed connection, fail every request in flight: the server has dropped the
        requests of that connection, and a new one (ZeroMQ reconnects) is a stranger to it."""
        while True:
            await self._monitor.recv_multipart()
            lost = list(self._queues)
            for rid in lost:
                message = "the connection to the server closed; the request is lost"
                self._queues[rid].put_nowait(ErrorReply(rid, ROUTE_LOST, message))
            if lost:
                log.warning("connection to the server closed", requests_lost=len(lost))

    async def _next(self, request_id: str) -> object:
        queue = self._queues.get(request_id)
        if queue is None:
            raise ServerError(ROUTE_LOST, "the request is no longer tracked", request_id)
        assert isinstance(queue, asyncio.Queue), "a shared request is read with `take`"
        msg = await self._wait(queue)
        if isinstance(msg, ErrorReply):
            self._queues.pop(request_id, None)
        return _final(msg)

    async def _wait(self, queue: asyncio.Queue[T]) -> T:
        loop = asyncio.get_running_loop()
        while True:
            if self._reader is not None and self._reader.done():
                self._reader.result()  # re-raise what ended the reader
            if not queue.empty():  # no timer to arm for a reply that is here
                return queue.get_nowait()
            try:
                async with asyncio.timeout(self.timeout):  # a timer, not a task as wait_for's
                    return await queue.get()
            except TimeoutError:
                if loop.time() - self._heard >= self.timeout:
                    raise TimeoutError(
                        f"no word from {self.address} for {self.timeout} s"
                    ) from None


class _Shared:
    """The entry of a request whose replies go, tagged, into a queue shared with others."""

    def __init__(self, queue: asyncio.Queue[tuple[int, object]], tag: int):
        self.queue, self.tag = queue, tag

    def put_nowait(self, msg: object) -> None:
        self.queue.put_nowait((self.tag, msg))


class AsyncStream(_Replies):
    """Async-iterates the GenerateDelta replies of one request; then `result` is set."""

    def __init__(self, client: AsyncClient, request_id: str):
        super().__init__(request_id)
        self.client = client

    def __aiter__(self) -> AsyncIterator[GenerateDelta]:
        return self

    async def __anext__(self) -> GenerateDelta:
        if self.result is not None:
            raise StopAsyncIteration
        delta = self._take(await self.client._next(self.request_id))
        if delta is None:
            self.client._queues.pop(self.request_id, None)
            raise StopAsyncIteration
        return delta

    async def aclose(self) -> None:
        """Abort the request if it is still running, and read to its end."""
        if self.result is None:
            with contextlib.suppress(ServerError):
                await self.client.abort(self.request_id)
            async for _ in self:
                pass
