"""How `memstep serve` starts its HTTP front: through CURVE, and refusals before any model loads."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

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
    args = ["--model", "random:tiny", "--num-threads", "1", "--zmq-host", "0.0.0.0"]
    args += ["--curve-secret-key", str(tmp_path / "server.secret")]
    # one argument: a z85 key may begin with "-", which argparse would take for a flag
    args += [f"--curve-client-keys={CLIENT_PUBLIC.decode()}"]
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
    res = _serve("--zmq-port", "0", "--host", "0.0.0.0")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "refusing to serve HTTP on '0.0.0.0' without an API key" in res.stderr


def test_an_http_port_in_use_is_a_one_line_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        res = _serve("--zmq-port", "0", "--port", str(taken.getsockname()[1]))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "cannot listen for HTTP on 127.0.0.1" in res.stderr.strip().splitlines()[-1]


def test_a_silent_core_ends_requests_with_504_instead_of_hanging():
    with ServerProcess(["--model", "random:tiny", "--num-threads", "1"]) as server:
        server.wait_ready()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "memstep.serving.http_front.http_server",
            "--zmq",
            server.address,
        ]
        cmd += ["--model-name", "random:tiny", "--port", str(port), "--core-timeout", "1.5"]
        front = subprocess.Popen(cmd)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_http(url)
            os.kill(server.info["core_pid"], signal.SIGSTOP)  # alive, but says nothing
            body = {"model": "random:tiny", "prompt": "abc", "max_tokens": 3}
            start = time.monotonic()
            whole = httpx.post(url + "/v1/completions", json=body, timeout=30)
            streamed = httpx.post(
                url + "/v1/completions", json={**body, "stream": True}, timeout=30
            )
            assert time.monotonic() - start < 15
            assert whole.status_code == streamed.status_code == 504
            assert whole.json()["error"]["code"] == "core_timeout"
            os.kill(server.info["core_pid"], signal.SIGCONT)
            long = {**body, "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=long, timeout=30) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
                os.kill(server.info["core_pid"], signal.SIGSTOP)  # silent mid-stream
                rest = [line for line in lines if line]
            # an error event, then [DONE]: a client reading to [DONE] ends too
            assert "core_timeout" in rest[-2] and rest[-1] == "data: [DONE]"
        finally:
            os.kill(server.info["core_pid"], signal.SIGCONT)
            front.terminate()
            front.wait(10)


def test_a_stream_past_its_deadline_ends_with_an_error_event_then_done():
    """`--request-timeout`: a stream whose core has gone quiet (but within --core-timeout) ends at
    its deadline with a core_timeout error event naming the deadline, then [DONE]; a choice of
    a two-choice response ends the same way (the alarm names no choice)."""
    with ServerProcess(["--model", "random:tiny", "--num-threads", "1"]) as server:
        server.wait_ready()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "memstep.serving.http_front.http_server",
            "--zmq",
            server.address,
        ]
        cmd += ["--model-name", "random:tiny", "--port", str(port), "--request-timeout", "3"]
        front = subprocess.Popen(cmd)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_http(url)
            for n in (1, 2):
                body = {"model": "random:tiny", "prompt": "abc", "max_tokens": 400, "n": n}
                body |= {"ignore_eos": True, "stream": True}
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                    lines = r.iter_lines()
                    assert next(lines).startswith("data: {")
                    os.kill(server.info["core_pid"], signal.SIGSTOP)
                    start = time.monotonic()
                    rest = [line for line in lines if line]
                os.kill(server.info["core_pid"], signal.SIGCONT)
                assert time.monotonic() - start < 10
                assert "core_timeout" in rest[-2] and "deadline" in rest[-2], rest[-2:]
                assert rest[-1] == "data: [DONE]"
        finally:
            os.kill(server.info["core_pid"], signal.SIGCONT)
            front.terminate()
            front.wait(10)


def _wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no HTTP front at {url}")


def test_health_is_503_while_a_new_executor_starts_then_200_again():
    """A killed executor with restarts left: /health says 503 "recovering" until the new one is
    ready, a request sent meanwhile waits and succeeds, then /health is 200 again."""
    with ServerProcess(["--model", "random:tiny", "--num-threads", "1"], http=True) as server:
        server.wait_ready()
        url = server.http_url
        assert httpx.get(url + "/health").json()["status"] == "ok"
        _unknown_paths_and_methods_get_openai_errors(url)
        os.kill(server.info["executor_pid"], signal.SIGKILL)
        seen: list[tuple[int, str]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            reply = httpx.get(url + "/health", timeout=10)
            seen.append((reply.status_code, reply.json()["status"]))
            if seen[-1] == (503, "recovering"):
                break
            time.sleep(0.02)
        assert seen[-1] == (503, "recovering"), seen
        body = {"model": "random:tiny", "prompt": "abc", "max_tokens": 3}
        during = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert during.status_code == 200 and during.json()["usage"]["completion_tokens"] == 3
        _wait_http(url)
        assert httpx.get(url + "/health").json()["status"] == "ok"


def test_a_client_that_hangs_up_on_a_whole_completion_aborts_it():
    """Not streamed: the front notices the closed connection and aborts the request in the core,
    which frees its pages long before its max_tokens."""
    with ServerProcess(["--model", "random:tiny", "--num-threads", "1"], http=True) as server:
        server.wait_ready()
        body = {"model": "random:tiny", "prompt": "abc", "max_tokens": 500, "ignore_eos": True}
        with Client(server.address, timeout=20) as core:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.http_url + "/v1/completions", json=body, timeout=0.25)
            deadline = time.monotonic() + 20
            stats = core.stats()
            while stats.finished.get("abort", 0) == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
                stats = core.stats()
            assert stats.finished.get("abort", 0) == 1, stats.finished
            assert stats.finished.get("length", 0) == 0  # it did not run to its end
            assert stats.num_running == 0 and stats.kv_pages_used == 0


def _unknown_paths_and_methods_get_openai_errors(url: str) -> None:
    missing = httpx.post(url + "/v1/embeddings", json={})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert "/v1/embeddings" in missing.json()["error"]["message"]
    wrong = httpx.get(url + "/v1/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405
    assert "POST" in wrong.headers["allow"]
