"""Executor loss in the engine core (in-process executor, planted losses): requests are
re-admitted and finish as without the loss, the restart budget ends a crash loop, and replay
applies the recorded losses where they happened."""

from __future__ import annotations

from pathlib import Path

import pytest

from memstep.core.config import EngineConfig
from memstep.core.engine import UnknownRequest
from memstep.core.recovery import EngineDead, RestartBudget
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import (
    ExecutorLost,
    PhaseChanged,
    RecoveryDone,
    RecoveryStarted,
    RequestFinished,
)
from memstep.executors.process.inprocess import local_engine
from memstep.replay.compare import compare
from memstep.replay.recording import Recording
from memstep.replay.replayer import replay

TINY = EngineConfig(model="random:tiny")
PROMPTS: list[str | list[int]] = [f"recover request {i}" for i in range(10)]
PARAMS = [SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True) for i in range(6)]
PARAMS += [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 4


def _of(records: list, cls: type) -> list:
    return [r for r in records if isinstance(r, cls)]


def _recording(records: list) -> Recording:
    started = records[0]
    header = {"config": started.config, "model_identity": started.model_identity}
    return Recording(Path("in-memory"), header, records, [])


@pytest.fixture(scope="module")
def clean():
    return local_engine(TINY).generate(PROMPTS, PARAMS)


@pytest.fixture(scope="module")
def killed():
    records: list = []
    engine = local_engine(TINY.replace(debug_kill_executor_at=(3, 9, 15)), [records.append])
    done = engine.generate(PROMPTS, PARAMS)
    engine.shutdown()
    return done, records


def test_requests_finish_as_without_the_losses(clean, killed):
    done, records = killed
    assert [c.token_ids for c in done] == [c.token_ids for c in clean]
    assert [c.text for c in done] == [c.text for c in clean]
    assert [(r.step, r.during) for r in _of(records, ExecutorLost)] == [
        (3, "step"),
        (9, "step"),
        (15, "step"),
    ]
    started = _of(records, RecoveryStarted)
    assert [r.num_readmitted for r in started] == [10, 10, 10]
    assert started[0].tokens_to_recompute == sum(len(t) for t in _prompt_ids(records)) + 10 * 3
    assert [r.num_starts for r in _of(records, RecoveryDone)] == [1, 1, 1]
    phases = [(r.old, r.new) for r in _of(records, PhaseChanged) if r.step == 3]
    assert phases == [
        ("no_spec", "recover"),
        ("recover", "profile"),
        ("profile", "warmup"),
        ("warmup", "capture"),
    ]


def _prompt_ids(records: list) -> list[list[int]]:
    return [r.prompt_token_ids for r in records if type(r).__name__ == "RequestAdded"]


def test_replay_applies_the_recorded_losses(killed):
    _, records = killed
    recording = _recording(records)
    run = replay(recording)
    assert compare(recording.derived, run.derived).is_identical
    assert [r.step for r in _of(run.records, ExecutorLost)] == [3, 9, 15]


def test_replay_without_the_recorded_losses_diverges(killed):
    _, records = killed
    recording = _recording(records)
    planted = recording.config["debug_kill_executor_at"]
    assert planted, "the replay must not plant the kills again: they are recorded inputs"
    without = _recording([r for r in records if not isinstance(r, ExecutorLost)])
    first = compare(without.derived, replay(without).derived).first
    assert first is not None and first.step == 3


def test_a_request_added_during_recovery_is_queued_and_served(clean):
    engine = local_engine(TINY.replace(debug_kill_executor_at=(2,)))
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:5], PARAMS[:5], strict=True)]
    while not engine.is_recovering:
        step()
    ids += [engine.add_request(p, sp) for p, sp in zip(PROMPTS[5:], PARAMS[5:], strict=True)]
    assert engine.is_recovering
    while engine.has_work():
        step()
    assert [tokens[i] for i in ids] == [c.token_ids for c in clean]


def test_an_abort_during_recovery_takes_effect_after_it_and_replays():
    records: list = []
    engine = local_engine(TINY.replace(debug_kill_executor_at=(2,)), [records.append])
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:4], PARAMS[:4], strict=True)]
    while not engine.is_recovering:
        engine.step()
    engine.step()  # the new executor has started, and is not yet profiled
    engine.abort(ids[1])
    with pytest.raises(UnknownRequest):
        engine.abort(ids[1])
    engine.run_until_idle()
    engine.shutdown()
    names = [type(r).__name__ for r in records]
    aborted = next(r for r in _of(records, RequestFinished) if r.reason == "abort")
    assert aborted.request_id == ids[1]
    assert names.index("RecoveryDone") < records.index(aborted)
    recording = _recording(records)
    assert compare(recording.derived, replay(recording).derived).is_identical


def test_past_the_restart_budget_every_request_fails_and_the_engine_is_dead():
    records: list = []
    cfg = TINY.replace(
        debug_kill_executor_at=(2,), debug_kill_restarted_executor=True, max_executor_restarts=2
    )
    engine = local_engine(cfg, [records.append])
    with pytest.raises(EngineDead, match="executor lost too often"):
        engine.generate(PROMPTS[:4], PARAMS[:4])
    assert [(r.during, r.gave_up) for r in _of(records, ExecutorLost)] == [
        ("step", False),
        ("warmup", False),
        ("warmup", True),
    ]
    assert [r.reason for r in _of(records, RequestFinished)] == ["executor_dead"] * 4
    assert not engine.has_work() and not engine.requests
    with pytest.raises(EngineDead):
        engine.step()
    engine.shutdown()
    assert records[-1] == PhaseChanged(2, "profile", "shutdown")  # warmup never began
    run = replay(_recording(records))
    assert compare(_recording(records).derived, run.derived).is_identical


def test_restart_budget_counts_within_its_window():
    budget = RestartBudget(limit=2, window_s=10.0)
    assert budget.take(0.0) and budget.take(1.0)
    assert not budget.take(5.0), "a third restart within 10 s is one too many"
    assert budget.take(10.5), "the restart at 0.0 has left the window"
    assert RestartBudget(limit=0, window_s=1.0).take(0.0) is False
