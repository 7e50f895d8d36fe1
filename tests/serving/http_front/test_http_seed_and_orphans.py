"""Unseeded HTTP requests take their seeds from the engine (`--seed`), as over ZMQ; and an
executor whose core was SIGKILLed exits even when the pipe its stderr writes to has no reader."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from memstep.cli.serve import ServerProcess

PROMPTS = ["Once upon a time", "The sea", "Numbers:"]


def _texts(seed: int) -> list[str]:
    args = ["--model", "random:tiny", "--num-threads", "1", "--no-record", "--seed", str(seed)]
    with ServerProcess(args, http=True) as server:
        server.wait_ready()
        return [
            httpx.post(
                server.http_url + "/v1/completions",
                json={"prompt": p, "max_tokens": 12, "temperature": 1.0},
                timeout=60,
            ).json()["choices"][0]["text"]
            for p in PROMPTS
        ]


def test_two_servers_with_the_same_seed_give_the_same_unseeded_texts():
    first, second, other = _texts(11), _texts(11), _texts(12)
    assert first == second
    assert all(a != b for a, b in zip(first, other, strict=True))  # the check can fail


def _descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    found = [int(c) for c in children]
    for child in list(found):
        found += _descendants(child)
    return found


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


def test_the_executor_of_a_killed_core_exits_with_its_stderr_pipe_closed(tmp_path):
    ready = tmp_path / "ready.json"
    cmd = [sys.executable, "-m", "memstep.cli.serve", "--model", "random:tiny"]
    cmd += ["--num-threads", "1", "--no-record", "--no-http", "--zmq-port", "0"]
    cmd += ["--standby-executor", "on", "--ready-file", str(ready), "--log-level", "info"]
    core = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline and core.poll() is None:
            time.sleep(0.2)
        info = json.loads(ready.read_text())
        while len(kids := _descendants(core.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)  # the standby starts a little after the executor
        time.sleep(1.0)
        assert info["executor_pid"] in kids and len(kids) >= 2  # the executor and the standby
        core.stdout.close()  # the pipes lose their reader
        core.stderr.close()
        os.kill(core.pid, signal.SIGKILL)
        core.wait()
        start = time.monotonic()
        while any(_alive(pid) for pid in kids) and time.monotonic() - start < 15:
            time.sleep(0.2)
        left = [pid for pid in kids if _alive(pid)]
        assert not left and time.monotonic() - start < 10
    finally:  # nothing of this test outlives it, whatever failed
        for pid in kids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if core.poll() is None:
            core.kill()
            core.wait()
