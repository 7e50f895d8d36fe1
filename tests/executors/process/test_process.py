"""The executor process behind ZeroMQ: same results as in-process, liveness, and SIGKILL."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from memstep.cli.serve import ServerProcess
from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams
from memstep.events.plan import PhaseReply
from memstep.executors.process.inprocess import local_engine
from memstep.executors.process.main import MAIN_ID
from memstep.executors.process.remote import ExecutorDied, ExecutorFailed, ProcessExecutor

TINY = EngineConfig(model="random:tiny")
TINY_SERVER = ["--model", "random:tiny", "--num-threads", "1"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def process_engine():
    engine = Engine(TINY, executor_factory=ProcessExecutor)
    yield engine
    engine.shutdown()


def test_process_executor_gives_the_in_process_results(process_engine):
    prompts: list[str | list[int]] = ["hello there", [5, 17, 200, 3], "memory step"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(max_tokens=9, temperature=0.8, seed=7),
    ]
    params.append(SamplingParams(max_tokens=5, top_p=0.5, temperature=1.0, seed=3))
    remote = process_engine.generate(prompts, params)
    local = local_engine(TINY).generate(prompts, params)
    assert [c.token_ids for c in remote] == [c.token_ids for c in local]
    assert [c.finish_reason for c in remote] == [c.finish_reason for c in local]
    assert process_engine.executor.pid != os.getpid()


def test_executor_error_is_reported_and_executor_keeps_running(process_engine):
    executor = process_engine.executor
    with pytest.raises(ExecutorFailed, match="Can't go to 'warmup'"):
        executor.enter_phase("warmup", process_engine.step_no)  # illegal from a serving kind
    (done,) = process_engine.generate(
        ["still alive"], SamplingParams(temperature=0.0, max_tokens=3)
    )
    assert len(done.token_ids) == 3


def test_garbled_message_gets_an_error_reply_and_the_executor_keeps_running(process_engine):
    executor = process_engine.executor
    executor._sock.send_multipart([MAIN_ID, b"\xc1 not msgpack"])
    with pytest.raises(ExecutorFailed, match="bad_message: not a msgpack record"):
        executor._wait_for(PhaseReply)
    (done,) = process_engine.generate([[9, 8, 7]], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(done.token_ids) == 2


def test_stopped_executor_is_declared_dead_by_heartbeat_timeout():
    executor = ProcessExecutor(TINY, 64, heartbeat_timeout=1.0)
    try:
        executor.check()
        os.kill(executor.pid, signal.SIGSTOP)  # alive as a process, but silent
        start = time.monotonic()
        with pytest.raises(ExecutorDied, match="sent no heartbeat"):  # noqa: PT012
            while time.monotonic() - start < 10:
                executor.check()
                time.sleep(0.05)
        # measured from the last heartbeat heard, which may precede SIGSTOP by up to one interval
        assert 1.0 < time.monotonic() - executor._beat.last_heard < 3.0
        assert time.monotonic() - start < 3.0
        assert _wait_gone(executor.pid, 5), "a silent executor is killed"
    finally:
        executor.close()


def test_close_stops_the_executor_and_removes_its_socket():
    executor = ProcessExecutor(TINY, 64)
    socket_dir = Path(executor.endpoint.removeprefix("ipc://")).parent
    assert socket_dir.is_dir()
    executor.close()
    assert executor.proc.returncode == 0
    assert not socket_dir.exists()


def test_executor_exits_when_its_core_is_killed():
    with ServerProcess(TINY_SERVER) as server:
        info = server.wait_ready()
        socket_dir = Path(_executor_endpoint(info["executor_pid"])).parent
        assert socket_dir.is_dir()
        os.kill(info["core_pid"], signal.SIGKILL)
        assert _wait_gone(info["executor_pid"], 5), "the orphaned executor exits by itself"
        assert not socket_dir.exists(), "and removes the dead core's socket dir"


def _executor_endpoint(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    return argv[argv.index("--endpoint") + 1].removeprefix("ipc://")


# --- through the server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    with ServerProcess(TINY_SERVER) as proc:
        proc.wait_ready()
        yield proc


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_the_core_never_loads_torch(server):
    assert "libtorch" not in _maps(server.info["core_pid"])
    assert "libtorch" in _maps(server.info["executor_pid"])


def test_ready_waits_for_the_submitted_step_and_says_so_when_the_executor_is_gone():
    """`ready` is False while the step runs (a timeout of 0 right after the hand-over), True
    once its result came (then `collect` returns it at once), and True when the executor died:
    `collect` raises that."""
    engine = Engine(TINY, executor_factory=ProcessExecutor)
    try:
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), "a")
        executor = engine.executor
        assert isinstance(executor, ProcessExecutor)
        assert engine.launch()
        waited = 0
        while not engine.step_ready(0.001):
            waited += 1
            assert waited < 10_000, "no result in 10 s"
        start = time.monotonic()
        assert engine.finish() and time.monotonic() - start < 0.5
        assert engine.launch()
        os.kill(executor.pid, signal.SIGKILL)
        assert _wait_gone(executor.pid, 10)
        deadline = time.monotonic() + 10
        while not executor.ready(0.01):
            assert time.monotonic() < deadline, "a dead executor never read as ready"
        with pytest.raises(ExecutorDied):
            executor.collect()
    finally:
        engine.executor.close()
