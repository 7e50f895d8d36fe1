"""Shared fixtures of the core process's tests (and its HTTP front's, below)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import zmq

from memstep.core.engine import Engine
from memstep.serving.core_config import ServerConfig
from memstep.serving.core_process import Server


@contextlib.contextmanager
def _turned(engine: Engine) -> Iterator[tuple[Server, zmq.Socket]]:
    server = Server(engine, ServerConfig(port=0))
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(server.endpoint)
    try:
        yield server, s
    finally:
        s.close(0)
        server.close()
        engine.shutdown()


@pytest.fixture(scope="session")
def turned_server():
    """A context manager: a real Server in front of `engine` on a real socket, turned by the
    test (`run_once`), and a DEALER socket connected to it; at its end both are closed and the
    engine is shut down."""
    return _turned
