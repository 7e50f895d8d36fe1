"""The core process's API socket: a ZeroMQ ROUTER bound with the server's options, and the ZAP
handler (RFC 27) that admits a CURVE client only if its public key is on the allowed list."""

from __future__ import annotations

import structlog
import zmq
from zmq.utils import z85

from memstep.core.config import ConfigError
from memstep.serving.core_config import ServerConfig

log = structlog.get_logger("memstep.server")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"


def bind(ctx: zmq.Context, cfg: ServerConfig) -> zmq.Socket:
    """The ROUTER socket, listening; ConfigError where the address cannot be bound."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a closed peer fails: disconnects
    sock.setsockopt(zmq.MAXMSGSIZE, cfg.hard_frame_bytes)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # ZMTP pings close connections to dead hosts
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
    if cfg.curve_secret_key is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, cfg.curve_secret_key)
        sock.setsockopt(zmq.ZAP_DOMAIN, b"memstep")
    host = cfg.host
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
        host = f"[{host}]"
    endpoint = f"tcp://{host}:{cfg.port or '*'}"
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        sock.close(0)
        raise ConfigError(f"cannot listen on {endpoint}: {exc}") from exc
    return sock


def zap_handler(ctx: zmq.Context) -> zmq.Socket:
    zap = ctx.socket(zmq.REP)
    zap.bind(ZAP_ENDPOINT)
    return zap


def answer_zap(zap: zmq.Socket, cfg: ServerConfig) -> None:
    """Answer every pending ZAP request: 200 for an allowed CURVE key, 400 otherwise."""
    while zap.poll(0):
        version, seq, _domain, _address, _identity, mechanism, *creds = zap.recv_multipart()
        key = z85.encode(creds[0]) if mechanism == b"CURVE" and creds else b""
        ok = key in cfg.curve_client_keys
        status = (b"200", b"OK") if ok else (b"400", b"client key not allowed")
        log.info("zap", allowed=ok, mechanism=mechanism)
        zap.send_multipart([version, seq, *status, key, b""])
