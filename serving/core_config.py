"""Where and how the core process's API socket listens (`ServerConfig`), and which hosts need
no keys (`is_loopback`)."""

from __future__ import annotations

import ipaddress

import attrs

from memstep.core.config import ConfigError


@attrs.frozen(kw_only=True)
class ServerConfig:
    """Where and how the API socket listens.  A non-loopback host needs CURVE keys."""

    host: str = "127.0.0.1"
    port: int = 5557  # 0: any free port (see Server.endpoint)
    max_frame_bytes: int = 1 << 20  # larger frames get frame_too_large
    keepalive_s: float = 1.0
    idle_poll_s: float = 0.05
    stats_interval_s: float = 10.0  # a "stats" log line this often while busy; 0: never
    curve_secret_key: bytes | None = None  # z85, 40 characters
    curve_client_keys: frozenset[bytes] = frozenset()  # z85 public keys allowed to connect
    dead_exit_s: float = 2.0  # once the engine gave up: answer health (dead) this long, then stop
    # while a new executor starts, this many new requests are queued (beside those that were
    # waiting or running, all kept), then new ones get `recovering` errors: 60 req/s for the
    # 17-18 s an 8B model's recovery took on an H200 is about 1,100
    max_new_while_recovering: int = 4096
    # a new request that finds this many waiting (admitted, not yet running) is refused with
    # `overloaded` (HTTP 503 + Retry-After) instead of queued; 0: no bound.  How to choose it:
    # docs/serving-overload.md
    max_waiting_requests: int = 0

    def __attrs_post_init__(self) -> None:
        if self.max_frame_bytes < 1024:
            raise ConfigError("max_frame_bytes must be >= 1024")
        if self.max_new_while_recovering < 0:
            raise ConfigError("max_new_while_recovering must be >= 0")
        if self.max_waiting_requests < 0:
            raise ConfigError("max_waiting_requests must be >= 0 (0: no bound)")
        if (self.curve_secret_key is None) != (not self.curve_client_keys):
            raise ConfigError("CURVE needs both a server secret key and allowed client keys")
        if not (is_loopback(self.host) or self.uses_curve):
            raise ConfigError(
                f"refusing to listen on {self.host!r} without CURVE: give --curve-secret-key "
                "and --curve-client-keys, or bind to a loopback address"
            )

    @property
    def uses_curve(self) -> bool:
        return self.curve_secret_key is not None

    @property
    def hard_frame_bytes(self) -> int:
        """ZMQ_MAXMSGSIZE: a larger frame makes ZeroMQ drop the connection unread."""
        return 4 * self.max_frame_bytes


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
