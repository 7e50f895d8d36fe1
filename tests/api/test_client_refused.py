"""A client that a CURVE server refuses gets an error in bounded time, never a hang.

A server that denies a client's key (ZAP) drops its connection; the client's DEALER then has no
connection to hand a message to, and a send without a deadline waits forever (seen once in
`test_http_front.py`, where `health()` hung the suite). The server here is a bare CURVE ROUTER
whose ZAP handler refuses everyone."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

from memstep.api.client import AsyncClient, Client, ServerError

SERVER_PUBLIC, SERVER_SECRET = zmq.curve_keypair()
STRANGER_PUBLIC, STRANGER_SECRET = zmq.curve_keypair()
KEYS = {
    "curve_server_key": SERVER_PUBLIC,
    "curve_public_key": STRANGER_PUBLIC,
    "curve_secret_key": STRANGER_SECRET,
}


@pytest.fixture
def refusing_server():
    ctx = zmq.Context()
    zap = ctx.socket(zmq.REP)
    zap.bind("inproc://zeromq.zap.01")
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.CURVE_SERVER, 1)
    router.setsockopt(zmq.CURVE_SECRETKEY, SERVER_SECRET)
    router.setsockopt(zmq.ZAP_DOMAIN, b"test")
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def deny() -> None:
        while not stop.is_set():
            if zap.poll(50):
                version, request_id, *_ = zap.recv_multipart()
                zap.send_multipart([version, request_id, b"400", b"denied", b"", b""])

    thread = threading.Thread(target=deny, daemon=True)
    thread.start()
    yield f"tcp://127.0.0.1:{port}"
    stop.set()
    thread.join()
    router.close(0)
    zap.close(0)
    ctx.term()


def in_bounded_time(fn, seconds: float = 30.0) -> list[BaseException]:
    """Run fn in a thread; fail if it has not returned within `seconds`; what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the client hung"
    return raised


def test_every_call_of_a_refused_client_fails_within_its_timeout(refusing_server):
    errors: list[type] = []

    def calls() -> None:
        with Client(refusing_server, timeout=1, connect_timeout=1, **KEYS) as client:
            for _ in range(6):  # the first ones while the refusal is in flight, then after
                with pytest.raises((TimeoutError, ConnectionError)) as caught:
                    client.health()
                errors.append(caught.type)

    assert in_bounded_time(calls) == []
    assert len(errors) == 6


def test_a_refused_async_client_fails_within_its_timeout(refusing_server):
    async def calls() -> None:
        async with AsyncClient(refusing_server, timeout=1, **KEYS) as client:
            for _ in range(4):
                # the dropped connection may also end a call as route_lost (its link closed)
                with pytest.raises((TimeoutError, ConnectionError, ServerError)):
                    await client.health()

    assert in_bounded_time(lambda: asyncio.run(calls())) == []
