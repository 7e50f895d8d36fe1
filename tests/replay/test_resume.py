"""Resuming from a dead engine's log (in-process, random:tiny): the unfinished requests are
re-admitted with their tokens and finish as without the crash, a torn last frame loses nothing
that matters, and the resumed engine's own log replays."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from memstep.core.config import EngineConfig
from memstep.core.sampling_params import InvalidRequest, SamplingParams
from memstep.events.types import RequestResumed
from memstep.executors.process.inprocess import local_engine
from memstep.replay.compare import compare
from memstep.replay.recorder import Recorder
from memstep.replay.recording import load
from memstep.replay.replayer import replay
from memstep.replay.resume import resume_point

TINY = EngineConfig(model="random:tiny")
PROMPTS: list[str | list[int]] = [f"resume request {i}" for i in range(6)]
PARAMS = [SamplingParams(max_tokens=12 + 4 * i, temperature=0.8, seed=i) for i in range(3)]
PARAMS += [
    SamplingParams(temperature=0.0, max_tokens=12 + 4 * i, ignore_eos=True) for i in range(3)
]
CRASH_AFTER_STEPS = 14


@pytest.fixture(scope="module")
def clean():
    return local_engine(TINY).generate(PROMPTS, PARAMS)


def _crashed_log(path: Path) -> None:
    """An engine recorded to `path` that stops mid-run with no shutdown, as a SIGKILL leaves it."""
    recorder = Recorder(path)
    engine = local_engine(TINY, [recorder])
    for prompt, sp in zip(PROMPTS, PARAMS, strict=True):
        engine.add_request(prompt, sp)
    for _ in range(CRASH_AFTER_STEPS):
        engine.step()
    assert engine.requests, "the crash must leave unfinished requests"
    recorder.writer.flush()  # what the OS holds when the process dies; no close, no shutdown


def _resume(old: Path, new: Path) -> dict[str, list[int]]:
    """Resume `old` into a fresh engine recording `new`; every request's whole output."""
    point = resume_point(load(old))
    recorder = Recorder(new, header={"resumed_from": point.link()})
    engine = local_engine(point.config(TINY), [recorder])
    outputs = {r.request_id: list(r.output_token_ids) for r in point.requests}
    for r in point.unfinished:
        params = r.params
        engine.resume_request(
            r.request_id, r.prompt_token_ids, params, r.output_token_ids, r.arrival_time
        )
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    engine.shutdown()
    recorder.close()
    return outputs


def test_a_resumed_engine_finishes_every_request_as_without_the_crash(tmp_path, clean):
    _crashed_log(tmp_path / "old.memlog")
    point = resume_point(load(tmp_path / "old.memlog"))
    assert 0 < len(point.unfinished) < len(PROMPTS), "some finished, some not, at the crash"
    outputs = _resume(tmp_path / "old.memlog", tmp_path / "new.memlog")
    assert [outputs[f"req-{i}"] for i in range(len(PROMPTS))] == [c.token_ids for c in clean]
    new = load(tmp_path / "new.memlog")
    assert new.header["resumed_from"]["path"] == str((tmp_path / "old.memlog").resolve())
    assert new.header["resumed_from"]["num_unfinished"] == len(point.unfinished)
    resumed = [r for r in new.records if isinstance(r, RequestResumed)]
    assert [r.request_id for r in resumed] == [r.request_id for r in point.unfinished]
    assert all(r.output_token_ids for r in resumed), "the tokens made before the crash carry"
    run = replay(new)
    assert compare(new.derived, run.derived).is_identical
    assert not run.skipped


def test_a_torn_last_frame_is_recomputed(tmp_path, clean):
    old = tmp_path / "old.memlog"
    _crashed_log(old)
    intact = resume_point(load(old))
    data = old.read_bytes()
    old.write_bytes(data[:-7])  # the last frame (a StepFinished) half-written
    torn = resume_point(load(old))
    assert torn.recording.problems and torn.recording.problems[0].kind == "torn"
    lost = sum(len(r.output_token_ids) for r in intact.requests) - sum(
        len(r.output_token_ids) for r in torn.requests
    )
    assert lost > 0, "the torn frame held tokens"
    assert "damaged" in torn.link()["damaged"]
    outputs = _resume(old, tmp_path / "new.memlog")
    assert [outputs[f"req-{i}"] for i in range(len(PROMPTS))] == [c.token_ids for c in clean]


def test_new_requests_of_a_resumed_engine_do_not_reuse_carried_ids(tmp_path):
    _crashed_log(tmp_path / "old.memlog")
    point = resume_point(load(tmp_path / "old.memlog"))
    engine = local_engine(point.config(TINY))
    first = point.unfinished[0]
    params = first.params
    args = (first.prompt_token_ids, params, first.output_token_ids, first.arrival_time)
    engine.resume_request(first.request_id, *args)
    new_ids = {
        engine.add_request("hello", SamplingParams(temperature=0.0, max_tokens=2)) for _ in range(8)
    }
    assert first.request_id not in new_ids
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.resume_request(first.request_id, *args)
    unseeded = attrs.evolve(first.params, seed=None)
    with pytest.raises(InvalidRequest, match="no seed"):
        engine.resume_request("other", first.prompt_token_ids, unseeded, [], 0.0)
    engine.shutdown()
