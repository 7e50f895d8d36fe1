"""How `memstep serve` starts its HTTP front: through CURVE, and refusals before any model loads."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import pytest
import zmq

from memstep.api.client import Client
from memstep.cli.serve import ServerProcess

SERVER_PUBLIC, SERVER_SECRET = zmq.curve_keypair()
CLIENT_PUBLIC, CLIENT_SECRET = zmq.curve_keypair()
STRANGER_PUBLIC, STRANGER_SECRET = zmq.curve_keypair()


def test_the_front_reaches_a_curve_core_that_still_refuses_strangers(tmp_path):
    (tmp_path / "server.secret").write_bytes(SERVER_SECRET)
    args = ["--model", "random:tiny", "--num-threads", "1", "--host", "0.0.0.0"]
    args += ["--curve-secret-key", str(tmp_path / "server.secret")]
    args += ["--curve-client-keys", CLIENT_PUBLIC.decode()]
    with ServerProcess(args, http=True) as server:
        server.wait_ready()
        body = {"model": "random:tiny", "prompt": "abc", "max_tokens": 3}
        reply = httpx.post(server.http_url + "/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(server.http_url + "/health").status_code == 200
        keys = {"curve_public_key": STRANGER_PUBLIC, "curve_secret_key": STRANGER_SECRET}
        stranger = Client(server.address, timeout=2, curve_server_key=SERVER_PUBLIC, **keys)
        with stranger, pytest.raises((TimeoutError, ConnectionError)):
            stranger.health()


def _serve(*flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "memstep.cli.main", "serve", "--model", "random:tiny", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_a_public_http_host_needs_an_api_key():
    res = _serve("--port", "0", "--http-host", "0.0.0.0")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "refusing to serve HTTP on '0.0.0.0' without an API key" in res.stderr


def test_an_http_port_in_use_is_a_one_line_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        res = _serve("--port", "0", "--http-port", str(taken.getsockname()[1]))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "cannot listen for HTTP on 127.0.0.1" in res.stderr.strip().splitlines()[-1]
