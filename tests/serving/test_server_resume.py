"""`memstep serve --resume LOG`: a server whose core and executor were SIGKILLed mid-run is
started again from its event log; every client re-attaches with the number of tokens it has and
gets exactly the missing tail, so that what it holds equals an uninterrupted run.

SmolLM2 with seeded temperature-0.8 and greedy requests for the real model; random:tiny for a
log whose last frame is torn, where clients hold tokens the log lost and must wait for them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from memstep.api.client import AsyncClient, Client, ServerError
from memstep.cli.serve import ServerProcess
from memstep.core.config import EngineConfig
from memstep.core.generation_config import sampling_defaults
from memstep.core.outputs import Completion
from memstep.core.sampling_params import SamplingParams
from memstep.events.log import MAGIC
from memstep.events.types import RequestNamed, RequestResumed
from memstep.executors.process.inprocess import local_engine
from memstep.replay.recording import load
from memstep.replay.resume import resume_point

TINY = ["--model", "random:tiny", "--num-threads", "1"]
SMOL = ["--model", "smollm2", "--dtype", "float32", "--num-threads", "1"]


def _requests(n_seeded: int, n_greedy: int, max_tokens: int, **extra) -> list:
    seeded = [
        SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=200 + i, **extra)
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
    engine = local_engine(EngineConfig(model=model, dtype="float32"))
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


async def _stream_until_killed(server: ServerProcess, requests: list, kill_at: int) -> list:
    """Stream every request until each has `kill_at` tokens (or is done), then SIGKILL the core
    and the executor; what each client holds: token ids, text pieces, the done if it came."""
    held = [{"ids": [], "text": "", "done": None} for _ in requests]
    killed = asyncio.Event()

    async def one(client: AsyncClient, i: int, prompt: str, sp: SamplingParams) -> None:
        stream = await client.generate(prompt, stream=True, request_id=f"story-{i}", **_wire(sp))
        try:
            async for delta in stream:
                held[i]["ids"].extend(delta.token_ids)
                held[i]["text"] += delta.text
                enough = all(len(h["ids"]) >= kill_at or h["done"] for h in held)
                if enough and not killed.is_set():
                    _kill(server)
                    killed.set()
            held[i]["done"] = stream.result
        except (TimeoutError, ServerError):
            assert killed.is_set(), "the stream broke before the kill"

    # the silence that ends a stream after the kill; before it, a loaded 2-core machine has
    # kept a step from answering for over 3 s
    clients = [AsyncClient(server.address, timeout=15) for _ in range(4)]
    try:
        tasks = [one(clients[i % 4], i, p, sp) for i, (p, sp) in enumerate(requests)]
        await asyncio.gather(*tasks)
    finally:
        for client in clients:
            await client.close()
    assert killed.is_set(), "every request finished before the kill"
    return held


def _kill(server: ServerProcess) -> None:
    os.kill(server.info["core_pid"], signal.SIGKILL)
    os.kill(server.info["executor_pid"], signal.SIGKILL)


async def _attach_all(address: str, held: list) -> list:
    """Every request without its done re-attached from the tokens its client holds."""

    async def one(client: AsyncClient, i: int) -> None:
        if held[i]["done"] is not None:
            return
        stream = await client.attach(f"story-{i}", from_index=len(held[i]["ids"]))
        async for delta in stream:
            held[i]["ids"].extend(delta.token_ids)
            held[i]["text"] += delta.text
        held[i]["done"] = stream.result

    async with AsyncClient(address, timeout=120) as client:
        await asyncio.gather(*(one(client, i) for i in range(len(held))))
    return held


def _assert_whole(held: list, expected: list[Completion]) -> None:
    for i, (got, want) in enumerate(zip(held, expected, strict=True)):
        assert got["ids"] == want.token_ids, f"request {i}: held + tail differs from a clean run"
        assert got["text"] == want.text, f"request {i}: text differs"
        assert got["done"].token_ids == want.token_ids and got["done"].text == want.text


def _memstep(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "memstep.cli.main", "--log-level", "warning", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_a_sigkilled_smollm2_server_resumed_from_its_log_gives_every_client_its_tail(tmp_path):
    requests = _requests(4, 4, max_tokens=32)
    expected = _clean_run("smollm2", requests)
    old_log = tmp_path / "old.memlog"
    with ServerProcess([*SMOL, "--record", str(old_log)]) as dead:
        dead.wait_ready()
        held = asyncio.run(asyncio.wait_for(_stream_until_killed(dead, requests, 6), 600))
        assert dead.proc.wait(30) == -signal.SIGKILL
    cut = [len(h["ids"]) for h in held]
    with ServerProcess([*SMOL, "--resume", str(old_log)]) as resumed:
        resumed.wait_ready()
        held = asyncio.run(asyncio.wait_for(_attach_all(resumed.address, held), 600))
        assert resumed.stop() == 0
        new = load(resumed.dir / "events.memlog")
    print(f"\ntokens each client held at the kill: {cut}", end="")
    _assert_whole(held, expected)
    assert new.header["resumed_from"]["path"] == str(old_log.resolve())
    named = {r.request_id: r.client_id for r in new.records if isinstance(r, RequestNamed)}
    resumed_ids = [r.request_id for r in new.records if isinstance(r, RequestResumed)]
    assert resumed_ids and set(resumed_ids) <= set(named)


def _frame_ends(data: bytes) -> list[int]:
    """Where each frame of a log's bytes ends: magic, a 2-byte version, then frames of an 8-byte
    head (payload length, crc32) and the payload; the header's frame first."""
    at, ends = len(MAGIC) + 2, []
    while at + 8 <= len(data):
        at += 8 + struct.unpack_from("<I", data, at)[0]
        if at <= len(data):
            ends.append(at)
    return ends


def _tear_a_frame_some_client_is_past(log: Path, held: list):
    """The log as a crash would leave it while writing its last frame that holds tokens a client
    already has (half of that frame, nothing after it), and the clients ahead of what it kept.
    Which frame is last when the kill lands depends on timing (a step planned after the tokens
    went out holds none), so the frames are tried from the end."""
    whole = log.read_bytes()
    for end in reversed(_frame_ends(whole)[1:]):
        log.write_bytes(whole[: end - 5])
        torn = load(log)
        kept = {r.client_id: len(r.output_token_ids) for r in resume_point(torn).requests}
        ahead = [i for i, h in enumerate(held) if len(h["ids"]) > kept[f"story-{i}"]]
        if ahead:
            return torn, ahead
    return load(log), []


def test_a_torn_log_tail_is_recomputed_and_a_client_ahead_of_it_waits(tmp_path):
    requests = _requests(3, 3, max_tokens=80, ignore_eos=True)
    expected = _clean_run("random:tiny", requests)
    old_log = tmp_path / "old.memlog"
    with ServerProcess([*TINY, "--record", str(old_log)]) as dead:
        dead.wait_ready()
        held = asyncio.run(asyncio.wait_for(_stream_until_killed(dead, requests, 20), 120))
        dead.proc.wait(30)
    torn, ahead = _tear_a_frame_some_client_is_past(old_log, held)
    assert torn.problems and torn.problems[0].kind == "torn"
    assert ahead, "some client holds tokens of the torn frame: its attach must wait for them"
    with ServerProcess([*TINY, "--resume", str(old_log)]) as resumed:
        resumed.wait_ready()
        held = asyncio.run(asyncio.wait_for(_attach_all(resumed.address, held), 120))
        with Client(resumed.address, timeout=30) as client:
            with pytest.raises(ServerError) as unknown:
                client.attach("story-0", from_index=0, stream=False)  # handed over already
            with pytest.raises(ServerError) as never:
                client.attach("never-sent", stream=False)
            fresh = client.generate("a new request", max_tokens=5, ignore_eos=True, temperature=0.0)
        assert resumed.stop() == 0
        new_log = resumed.dir / "events.memlog"
        replayed = _memstep("replay", str(new_log))
        shown = _memstep("inspect", str(new_log))
        link = load(new_log).header["resumed_from"]
    _assert_whole(held, expected)
    assert unknown.value.code == never.value.code == "unknown_request"
    assert len(fresh.token_ids) == 5
    assert "torn" in link["damaged"] and link["num_unfinished"] == len(requests)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert f"resumed  from {old_log.resolve()}" in shown.stdout, shown.stdout
    assert f"{len(requests)} unfinished requests re-admitted" in shown.stdout


def test_resume_refuses_a_file_that_is_not_a_log(tmp_path):
    bogus = tmp_path / "not-a-log"
    bogus.write_bytes(b"hello")
    done = _memstep("serve", *TINY, "--no-http", "--no-record", "--resume", str(bogus))
    assert done.returncode == 2 and "not a memstep log" in done.stderr, done.stderr
