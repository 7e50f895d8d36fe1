"""The HTTP front's bounds: request size, connections, read timeouts, deadlines, log volume.

An outsider on the network must not be able to make the front share fate with its other users: a
body over `max_request_bytes` is refused with 413 before it reaches the core (whose ZeroMQ link
would drop a frame past its hard limit, and with it every request in flight); a connection past
`max_connections` is closed as it opens; a connection that has not sent a whole request head within
`header_timeout_s` (an idle or a slowloris connection) is closed; a body not read within
`body_timeout_s` is a 408; every request ends by `request_timeout_s`; a request head (request line
and headers) past `MAX_HEAD_BYTES` is a 431, read no further; and the front's warnings are
rate-limited, so a flood cannot fill a disk with log lines.  A request refused before it is read
whole is closed gracefully (`serving/http_front/lingering.py`), so its client reads the refusal
instead of a reset.  docs/limits.md lists them with their flags.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import attrs
from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from memstep.core.config import ConfigError
from memstep.serving.http_front.lingering import LingeringTransport
from memstep.serving.http_front.openai_protocol import OpenAIError

log = logging.getLogger("uvicorn.error")
# a request line and its headers: past this, 431 (read no further than one more network read)
MAX_HEAD_BYTES = 64 << 10


@attrs.frozen(kw_only=True)
class HttpLimits:
    """The bounds of one HTTP front (flags of `memstep serve`, documented in docs/limits.md)."""

    max_request_bytes: int = 2 << 20  # larger bodies: 413 request_too_large
    max_connections: int = 8192  # connections past this are closed as they open
    header_timeout_s: float = 10.0  # a connection's time to send a whole request head
    body_timeout_s: float = 30.0  # a request's time to send its body: 408 after
    keepalive_timeout_s: float = 5.0  # an idle keep-alive connection closes after
    request_timeout_s: float = 600.0  # a request's deadline, from arrival to its last byte
    log_lines_per_s: float = 5.0  # warnings past this rate are counted, not written

    def __attrs_post_init__(self) -> None:
        if self.max_request_bytes < 1024:
            raise ConfigError("max_request_bytes must be >= 1024")
        if self.max_connections < 1:
            raise ConfigError("max_connections must be >= 1")
        timeouts = [self.header_timeout_s, self.body_timeout_s, self.keepalive_timeout_s]
        if min([*timeouts, self.request_timeout_s]) <= 0:
            raise ConfigError("HTTP timeouts must be > 0")

    def as_argv(self) -> list[str]:
        """The front's command-line flags for these limits."""
        return [
            f"--{f.name.replace('_', '-')}={getattr(self, f.name)}"
            for f in attrs.fields(type(self))
        ]


class GuardedHttptools(HttpToolsProtocol):
    """uvicorn's httptools protocol under the guards (a C parser and writer: h11, pure Python,
    cost the front more CPU a streamed chunk than the rest of its work), refusing an HTTP/1.1
    request without a Host header (RFC 9112), as h11 did."""

    limits = HttpLimits()
    refused = 0  # connections closed at once, past max_connections
    timed_out = 0  # connections closed for sending no whole request head in time
    head_timer: asyncio.TimerHandle | None = None
    lingering: LingeringTransport
    mid_request = False  # a request's head or body is still coming
    in_head = False  # a request's head is still coming
    head_bytes = 0  # bytes read while in its head

    def _admit(self, transport: asyncio.Transport) -> None:
        """After uvicorn's connection_made: close a connection past the cap, else start the
        clock for its first request head."""
        if len(self.connections) > self.limits.max_connections:
            GuardedHttptools.refused += 1
            log.warning("connection refused: %d open", len(self.connections) - 1)
            transport.abort()
            return
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_late)

    def _cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_late(self) -> None:
        self.head_timer = None
        if not self.transport.is_closing():  # armed until a whole head comes: none did
            GuardedHttptools.timed_out += 1
            self.lingering.close_now()

    def send_400_response(self, msg: str) -> None:
        """OpenAI's JSON error object for a request the parser refused, then close."""
        self._refuse(b"400 Bad Request", OpenAIError(400, msg, code="invalid_http"))

    def _refuse(self, status: bytes, error: OpenAIError) -> None:
        """Answer `error` and close, gracefully: the client may still be sending."""
        body = json.dumps(error.body()).encode()
        head = (
            b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        self.transport.write(head + body)
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.lingering = LingeringTransport(transport, lambda: self.mid_request)
        self.transport = self.lingering  # type: ignore[assignment]
        self._admit(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self.lingering.stop_timer()
        super().connection_lost(exc)

    def eof_received(self) -> None:
        if self.lingering.lingering:  # the client sent all it had: the refusal is read or not
            self.lingering.close_now()

    def data_received(self, data: bytes) -> None:
        if self.lingering.lingering:
            self.lingering.drop(len(data))
            return
        super().data_received(data)
        if self.in_head and not self.transport.is_closing():
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                message = f"the request line and headers are over {MAX_HEAD_BYTES} bytes"
                error = OpenAIError(431, message, code="request_header_too_large")
                self._refuse(b"431 Request Header Fields Too Large", error)

    def on_message_begin(self) -> None:
        self.mid_request, self.in_head, self.head_bytes = True, True, 0
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()  # a whole request head came
        self.in_head = False
        if self.parser.get_http_version() == "1.1" and not any(
            name == b"host" for name, _ in self.headers
        ):
            self.send_400_response("Missing required header: Host")
            return
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        queued = bool(self.pipeline)  # a pipelined request whose head came already
        super().on_response_complete()
        if not queued and not self.transport.is_closing():
            self._arm_head_timer()

    def on_body(self, body: bytes) -> None:
        if not self.transport.is_closing():  # not the rest of a refused request
            super().on_body(body)

    def on_message_complete(self) -> None:
        self.mid_request = False
        if not self.transport.is_closing():
            super().on_message_complete()


def guarded_protocol(limits: HttpLimits) -> type[GuardedHttptools]:
    """The protocol class uvicorn builds each connection with, under `limits`."""
    return type("GuardedHttptools", (GuardedHttptools,), {"limits": limits})


async def read_body(request: Request, limits: HttpLimits) -> bytes:
    """The request's body: 413 past `max_request_bytes` (from Content-Length, before reading
    a byte, or as it streams in), 408 past `body_timeout_s`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_request_bytes:
        raise too_large(int(declared), limits.max_request_bytes)
    try:
        return await asyncio.wait_for(_read_capped(request, limits), limits.body_timeout_s)
    except TimeoutError:
        raise OpenAIError(
            408, f"the request body took over {limits.body_timeout_s} s", code="body_timeout"
        ) from None
    except ClientDisconnect:
        raise OpenAIError(499, "the client closed the connection", code="client_closed") from None


async def _read_capped(request: Request, limits: HttpLimits) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_request_bytes:
            raise too_large(size, limits.max_request_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(size: int, limit: int) -> OpenAIError:
    message = f"the request has {size} bytes, over the limit of {limit} (--max-request-bytes)"
    return OpenAIError(413, message, code="request_too_large")


class RateLimited(logging.Filter):
    """Lets `per_s` records a second through (a burst of as many), counts the rest, and says
    how many were dropped with the next record it lets through."""

    def __init__(self, per_s: float):
        super().__init__()
        self.per_s = per_s
        self.tokens = per_s
        self.last = time.monotonic()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        self.tokens = min(self.per_s, self.tokens + (now - self.last) * self.per_s)
        self.last = now
        if self.tokens < 1:
            self.dropped += 1
            return False
        self.tokens -= 1
        if self.dropped:
            record.msg = f"{record.msg} ({self.dropped} similar lines dropped)"
            self.dropped = 0
        return True


def limit_log_rate(per_s: float) -> None:
    """Rate-limit uvicorn's warnings (one per refused or malformed request otherwise)."""
    for name in ("uvicorn.error", "uvicorn"):
        logging.getLogger(name).addFilter(RateLimited(per_s))
