"""Executor crash recovery through the server: zero requests lost, a crash loop ends, and the
logs of both replay.

The executor process is SIGKILLed at three steps of a run of 32 streaming requests on the real
model (16 seeded at temperature 0.8, 16 greedy); every stream must equal an uninterrupted
in-process run token for token, with no token repeated or missing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memstep.api.client import AsyncClient, Client, ServerError
from memstep.cli.serve import EXIT_ENGINE_DEAD, ServerProcess
from memstep.core.config import EngineConfig
from memstep.core.generation_config import sampling_defaults
from memstep.core.outputs import Completion
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import ExecutorLost, RecoveryDone, RequestFinished, RequestPreempted
from memstep.executors.process.inprocess import local_engine
from memstep.replay.recording import load

TINY = ["--model", "random:tiny", "--num-threads", "1"]
SMOL = ["--model", "smollm2", "--dtype", "float32", "--quantization", "none", "--num-threads", "1"]
KILL_STEPS = (5, 14, 24)


def _requests(n_seeded: int, n_greedy: int, max_tokens: int, **extra) -> list:
    seeded = [
        SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=100 + i, **extra)
        for i in range(n_seeded)
    ]
    greedy = [SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)] * n_greedy
    return [
        (f"Write one sentence about the number {i}.", sp) for i, sp in enumerate(seeded + greedy)
    ]


def _clean_run(model: str, requests: list) -> list[Completion]:
    """The uninterrupted in-process run, each request with the params the server gives it: what
    the wire sends over the model's own defaults (`--generation-config auto`: SmolLM2's top-p 0.9
    where the wire sends none)."""
    engine = local_engine(EngineConfig(model=model, dtype="float32", quantization="none"))
    defaults = sampling_defaults(engine.source, engine.cfg.generation_config)
    served = [SamplingParams.from_dict({**defaults, **_wire(sp)}) for _, sp in requests]
    return engine.generate([p for p, _ in requests], served)


def _wire(sp: SamplingParams) -> dict:
    return {
        "max_tokens": sp.max_tokens,
        "temperature": sp.temperature,
        "seed": sp.seed,
        "ignore_eos": sp.ignore_eos,
    }


async def _stream_all(address: str, requests: list, started: asyncio.Event | None = None) -> list:
    async def one(client: AsyncClient, prompt: str, sp: SamplingParams) -> dict:
        got: dict = {"deltas": [], "done": None, "error": None}
        stream = await client.generate(prompt, stream=True, **_wire(sp))
        try:
            async for delta in stream:
                got["deltas"].extend(delta.token_ids)
                if started is not None:
                    started.set()
            got["done"] = stream.result
        except ServerError as exc:
            got["error"] = exc
        return got

    clients = [AsyncClient(address, timeout=60) for _ in range(4)]
    try:
        tasks = [one(clients[i % 4], p, sp) for i, (p, sp) in enumerate(requests)]
        return await asyncio.gather(*tasks)
    finally:
        for client in clients:
            await client.close()


def _assert_identical(results: list, expected: list[Completion]) -> None:
    for i, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert got["error"] is None, f"request {i}: {got['error']}"
        assert got["deltas"] == want.token_ids, f"request {i}: stream differs from the clean run"
        assert got["done"].token_ids == want.token_ids
        assert got["done"].text == want.text


def _replay(log: Path) -> subprocess.CompletedProcess:
    return _memstep("replay", str(log))


def _memstep(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "memstep.cli.main", "--log-level", "warning", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _of(records: list, cls: type) -> list:
    return [r for r in records if isinstance(r, cls)]


def test_three_executor_kills_on_smollm2_lose_no_token_and_the_log_replays():
    requests = _requests(16, 16, max_tokens=16)
    expected = _clean_run("smollm2", requests)
    kills = ",".join(map(str, KILL_STEPS))
    with ServerProcess([*SMOL, "--debug-kill-executor-at", kills]) as server:
        server.wait_ready()
        results = asyncio.run(asyncio.wait_for(_stream_all(server.address, requests), 600))
        with Client(server.address, timeout=10) as client:
            health = client.health()
            stats = client.stats()
        assert server.stop() == 0
        log = server.dir / "events.memlog"
        records = load(log).records
        replayed = _replay(log)
    assert health.status == "ok"
    _assert_identical(results, expected)
    losses, done = _of(records, ExecutorLost), _of(records, RecoveryDone)
    assert [r.step for r in losses] == list(KILL_STEPS)
    assert all("SIGKILL" in r.reason and r.during == "step" and not r.gave_up for r in losses)
    assert [r.step for r in done] == list(KILL_STEPS)
    evicted = [r.cause for r in records if isinstance(r, RequestPreempted)]
    assert stats.num_requeues == evicted.count("recovery") > 0  # the losses' requeues, apart
    assert stats.num_preemptions == evicted.count("preemption")
    for r in done:
        print(
            f"\nrecovery at step {r.step}: {r.seconds:.2f} s ({r.num_readmitted} requests, "
            f"{r.tokens_to_recompute} tokens recomputed)",
            end="",
        )
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr


def test_executor_sigkilled_from_outside_mid_stream_is_recovered_and_recorded():
    requests = _requests(4, 4, max_tokens=60, ignore_eos=True)
    expected = _clean_run("random:tiny", requests)
    with ServerProcess(TINY) as server:
        info = server.wait_ready()

        async def run() -> list:
            started = asyncio.Event()
            task = asyncio.create_task(_stream_all(server.address, requests, started))
            await asyncio.wait_for(started.wait(), 30)
            os.kill(info["executor_pid"], signal.SIGKILL)
            return await task

        results = asyncio.run(asyncio.wait_for(run(), 120))
        with Client(server.address, timeout=10) as client:
            health = client.health()
        assert server.stop() == 0
        log = server.dir / "events.memlog"
        records = load(log).records
        replayed = _replay(log)
        shown = _memstep("inspect", str(log))
        plotted = _memstep("plot", str(log), "-o", str(server.dir / "memory.png"))
        png = (server.dir / "memory.png").read_bytes()
    _assert_identical(results, expected)
    assert health.status == "ok" and health.executor_pid not in (0, info["executor_pid"])
    assert shown.returncode == 0 and "executor losses: 1, recoveries: 1" in shown.stdout
    assert f"executor process {info['executor_pid']} died (killed by SIGKILL)" in shown.stdout
    assert plotted.returncode == 0 and png.startswith(b"\x89PNG"), plotted.stderr
    (lost,) = _of(records, ExecutorLost)
    assert f"{info['executor_pid']} died (killed by SIGKILL)" in lost.reason
    assert not _of(records, RequestFinished) or all(
        r.reason == "length" for r in _of(records, RequestFinished)
    )
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr


def test_a_crash_loop_fails_every_client_reports_dead_and_exits_non_zero():
    args = [*TINY, "--debug-kill-executor-at", "3", "--debug-kill-restarted-executor"]
    requests = _requests(2, 2, max_tokens=200, ignore_eos=True)
    with ServerProcess([*args, "--max-executor-restarts", "2"]) as server:
        server.wait_ready()
        results = asyncio.run(asyncio.wait_for(_stream_all(server.address, requests), 120))
        with Client(server.address, timeout=10) as client:
            health = client.health()
            with pytest.raises(ServerError) as refused:
                client.generate("anyone there?", max_tokens=2, temperature=0.0)
        start = time.monotonic()
        code = server.proc.wait(timeout=30)
        exited_after = time.monotonic() - start
        log = server.dir / "events.memlog"
        records = load(log).records
        replayed = _replay(log)
    for got in results:
        assert got["error"] is not None and got["error"].code == "executor_dead", got
        assert len(got["deltas"]) <= 3, "only steps 0-2 ran before the loss at step 3"
    assert health.status == "dead" and not health.executor_alive
    assert "executor lost too often" in health.detail
    assert refused.value.code == "executor_dead"
    assert code == EXIT_ENGINE_DEAD and exited_after < 10
    losses = _of(records, ExecutorLost)
    assert [(r.step, r.during, r.gave_up) for r in losses] == [
        (3, "step", False),
        (3, "warmup", False),
        (3, "warmup", True),
    ]
    assert {r.reason for r in _of(records, RequestFinished)} == {"executor_dead"}
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
