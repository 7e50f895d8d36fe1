"""A connection closed while its client is still sending is closed gracefully (a lingering close).

When the front refuses a request before reading all of it (413 for a body past the limit, 431 for
a head past its bound, 400 for bytes that are not HTTP), closing the socket at once with unread
bytes in it makes the kernel answer with a TCP reset: a client still sending its body gets an
error on its write and never reads the refusal.  So `close` with a request coming in writes the
response's end (a FIN after it), then reads and drops what the client still sends, up to
`LINGER_BYTES` and `LINGER_S`, and closes when the client has closed its side; past either bound
it closes (or resets) anyway, so a client that never stops cannot hold the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

LINGER_S = 5.0  # a refused request's client has this long to finish sending and read the refusal
LINGER_BYTES = 64 << 20  # read and dropped at most; past it, a reset


class LingeringTransport:
    """The connection's transport as uvicorn uses it, but `close` lingers while `mid_request()`
    (a request's head or body is still coming); every other call goes to the transport."""

    def __init__(self, transport: asyncio.Transport, mid_request: Callable[[], bool]):
        self.transport = transport
        self.mid_request = mid_request
        self.lingering = False
        self.num_left = LINGER_BYTES
        self.timer: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self.transport.is_closing()

    def close(self) -> None:
        """Close now if no request is coming in; else write the end and linger."""
        if self.is_closing():
            return
        if not self.mid_request():
            self.transport.close()
            return
        self.lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()  # after what is buffered: the client reads the refusal
        self.transport.resume_reading()
        self.timer = asyncio.get_running_loop().call_later(LINGER_S, self.close_now)

    def drop(self, num_bytes: int) -> None:
        """Bytes that came while lingering: dropped; a reset past `LINGER_BYTES`."""
        self.num_left -= num_bytes
        if self.num_left < 0:
            self.stop_timer()
            self.transport.abort()

    def close_now(self) -> None:
        self.stop_timer()
        self.transport.close()

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
