"""Must-show 4 of issue 55: the router owns its replicas' lives.  A router killed with SIGKILL
takes its replicas and their executors with it; a replica paused past the timeout is taken back
once it answers again; a `--replica` off this machine without CURVE is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from router_helpers import MODEL, running

from memstep.api.client import Client
from memstep.cli.serve import ServerProcess
from memstep.cli.serve_replicas import check_replicas_local
from memstep.core.config import ConfigError
from memstep.events.routing import ReplicaLost, ReplicaReturned, RequestRouted
from memstep.router.replay import load_router_log, replay_router, summarize


def _gone(pid: int) -> bool:
    """No such process, or only its exit status left (a zombie its new parent has not reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status


def _wait(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_router_takes_its_replicas_and_executors_with_it():
    with ServerProcess([*MODEL, "--data-parallel-size", "2"]) as router:
        info = router.wait_ready()
        pids = [p[k] for p in info["replicas"] for k in ("core_pid", "executor_pid")]
        assert len(pids) == 4 and not any(_gone(pid) for pid in pids)
        os.kill(router.proc.pid, signal.SIGKILL)
        router.proc.wait(10)
        killed = time.monotonic()
        assert _wait(lambda: all(_gone(pid) for pid in pids), 10.0), (
            [pid for pid in pids if not _gone(pid)],
            router.log(),
        )
        assert time.monotonic() - killed < 10.0


def test_a_replica_started_by_hand_does_not_follow_its_parent(monkeypatch):
    """The tie is only for replicas the router started (PARENT_ENV): `memstep serve` run from
    a shell that then exits keeps serving, as before."""
    from memstep.router import lifeline

    monkeypatch.delenv(lifeline.PARENT_ENV, raising=False)
    lifeline.follow_parent()  # no tie, no thread, no exit
    assert not any(t.name == "router-watch" for t in __import__("threading").enumerate())
    assert lifeline.replica_env({})[lifeline.PARENT_ENV] == str(os.getpid())


def test_a_replica_whose_router_died_before_the_tie_exits():
    """The race the watch closes: a parent gone before prctl is seen at start (getppid)."""
    code = "from memstep.router.lifeline import follow_parent; follow_parent(); print('alive')"
    env = {**os.environ, "MEMSTEP_ROUTER_PID": "1"}  # not its parent: as if it had died
    command = [sys.executable, "-c", code]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == -signal.SIGTERM and "alive" not in done.stdout
    assert "the router was gone at start" in done.stderr


def test_a_paused_replica_serves_again_after_sigcont(replicas, tmp_path: Path):
    endpoints = [p.address for p in replicas]
    paused = replicas[1].info["core_pid"]
    log = tmp_path / "r.memlog"
    with running(endpoints, log, policy="round-robin", replica_timeout_s=2.0) as router:
        os.kill(paused, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            assert _wait(lambda: router.replicas[1].lost, 8.0), "the pause was not noticed"
            time.sleep(max(0.0, 10.0 - (time.monotonic() - stopped)))
        finally:
            os.kill(paused, signal.SIGCONT)
        assert _wait(lambda: not router.replicas[1].lost, 60.0), replicas[1].log()
        with Client(router.endpoint) as client:
            for i in range(4):
                assert client.generate(f"after the pause {i}", max_tokens=4, seed=i).usage
    records = load_router_log(log).records
    kinds = [type(r) for r in records]
    assert kinds.index(ReplicaLost) < kinds.index(ReplicaReturned)
    after = records[kinds.index(ReplicaReturned) :]
    assert {r.replica for r in after if isinstance(r, RequestRouted)} == {0, 1}
    assert replay_router(load_router_log(log)) == (4, None)
    assert [r["replica"] for r in summarize(load_router_log(log))["returned"]] == [1]


def test_a_plaintext_replica_off_this_machine_exits_2():
    argv = ["serve", "--model", "random:tiny", "--no-http", "--replica", "tcp://192.0.2.7:5555"]
    command = [sys.executable, "-m", "memstep.cli.main", *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "tcp://192.0.2.7:5555 is not on this machine" in done.stderr
    assert "--replica-server-key" in done.stderr


@pytest.mark.parametrize("endpoint", ["tcp://10.0.0.1:1", "tcp://[2001:db8::1]:7", "tcp://*:5"])
def test_a_replica_endpoint_off_this_machine_is_refused(endpoint: str):
    with pytest.raises(ConfigError, match="in clear"):
        check_replicas_local([endpoint])


def test_a_replica_on_this_machine_needs_no_curve():
    check_replicas_local(["tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:2", "ipc://x"])
