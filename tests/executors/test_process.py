"""The executor process behind ZeroMQ: same results as in-process, liveness, and SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from memstep.api.client import AsyncClient, Client, ServerError
from memstep.cli.serve import ServerProcess
from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams
from memstep.events.plan import PhaseReply
from memstep.executors.inprocess import local_engine
from memstep.executors.process import MAIN_ID
from memstep.executors.remote import ExecutorDied, ExecutorFailed, ProcessExecutor

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
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=9, temperature=0.8, seed=7)]
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
    (done,) = process_engine.generate(["still alive"], SamplingParams(max_tokens=3))
    assert len(done.token_ids) == 3


def test_garbled_message_gets_an_error_reply_and_the_executor_keeps_running(process_engine):
    executor = process_engine.executor
    executor._sock.send_multipart([MAIN_ID, b"\xc1 not msgpack"])
    with pytest.raises(ExecutorFailed, match="bad_message: not a msgpack record"):
        executor._wait_for(PhaseReply)
    (done,) = process_engine.generate([[9, 8, 7]], SamplingParams(max_tokens=2))
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


def test_sigkill_of_the_executor_mid_stream_fails_every_waiting_client_within_2s(server):
    results = asyncio.run(asyncio.wait_for(_kill_mid_stream(server), 60))
    streamed, waiting, health, after = results
    assert len(streamed) == 8 and len(waiting) == 2
    for outcome in streamed + waiting:
        assert outcome["error"] is not None, f"no error reply: {outcome}"
        assert outcome["error"].code == "executor_dead"
        assert "SIGKILL" in outcome["error"].message
        assert outcome["latency"] < 2.0, f"error came {outcome['latency']:.2f} s after the kill"
    assert all(o["deltas"] >= 1 for o in streamed), "the kill came mid-stream"
    assert health.status == "executor_dead" and not health.executor_alive
    assert "SIGKILL" in health.detail
    assert after.kv_pages_used == 0 and after.num_running == 0 and after.num_inflight == 0
    assert after.finished.get("executor_dead") == 10
    with Client(server.address, timeout=10) as client, pytest.raises(ServerError) as err:
        client.generate("anyone there?", max_tokens=2)
    assert err.value.code == "executor_dead"
    assert server.proc.poll() is None, "the core stays up"


async def _kill_mid_stream(server):
    clients = [AsyncClient(server.address, timeout=30) for _ in range(10)]
    first_delta = [asyncio.Event() for _ in range(8)]
    killed_at: list[float] = []

    async def streamed(i: int) -> dict:
        outcome = {"deltas": 0, "error": None, "latency": None}
        params = dict(max_tokens=480, ignore_eos=True, temperature=0.9, seed=i)
        stream = await clients[i].generate(f"stream {i}", stream=True, **params)
        try:
            async for _ in stream:
                outcome["deltas"] += 1
                first_delta[i].set()
        except ServerError as exc:
            outcome["error"], outcome["latency"] = exc, time.monotonic() - killed_at[0]
        return outcome

    async def waiting(i: int) -> dict:
        outcome = {"error": None, "latency": None}
        try:
            await clients[i].generate(f"plain {i}", max_tokens=480, ignore_eos=True)
        except ServerError as exc:
            outcome["error"], outcome["latency"] = exc, time.monotonic() - killed_at[0]
        return outcome

    tasks = [asyncio.create_task(streamed(i)) for i in range(8)]
    tasks += [asyncio.create_task(waiting(i)) for i in (8, 9)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_delta)), 20)
    killed_at.append(time.monotonic())
    os.kill(server.info["executor_pid"], signal.SIGKILL)
    outcomes = await asyncio.gather(*tasks)
    health = await clients[0].health()
    stats = await clients[0].stats()
    for client in clients:
        await client.close()
    return outcomes[:8], outcomes[8:], health, stats
