"""Replay reproduces a run whose speculation adapted itself: the automatic threshold switched
speculation off and back on, and requests' K dropped and rose. The threshold comes from wall
time, so the recording's executor is made slow on purpose (spec steps of four requests or more,
then plain steps); the replay's is not, and must still run every step as recorded, because it
reads the threshold from the log. A replay that ignores the recorded threshold diverges."""

from __future__ import annotations

import time
from pathlib import Path

import attrs
import pytest
from replay_helpers import isolate_heap, mixed_params

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams
from memstep.core.spec_threshold import PROBE_PERIOD
from memstep.events.plan import StepPlan, StepResult
from memstep.events.types import DraftLengthChanged, SpecThresholdChanged, StepFinished
from memstep.executors.process.inprocess import InProcessExecutor
from memstep.replay.compare import compare, replayable_bytes
from memstep.replay.recorder import open_recorder
from memstep.replay.recording import Recording, load
from memstep.replay.replayer import replay

CFG = EngineConfig(
    model="random:tiny",
    max_num_seqs=8,
    num_threads=1,
    speculative_method="ngram",
    num_speculative_tokens=3,
)
WAVES = [8, 2, 8, 3, 1, 8, 2, 8, 8, 3, 8, 2, 8, 8]


@attrs.define
class Costs:
    """Which steps the recording's executor slows down: first `spec` steps of four or more
    requests and plain steps of fewer (spec pays only below 4), then, from `STRETCH` steps after
    the engine switched speculation off, every plain step (spec pays everywhere)."""

    STRETCH = 40
    switched_at: int | None = None

    def delay(self, plan: StepPlan) -> float:
        big = len(plan.seqs) >= 4
        if self.switched_at is None or plan.step < self.switched_at + self.STRETCH:
            return 0.02 if (plan.kind == "spec") == big else 0.0
        return 0.04 if plan.kind == "no_spec" else 0.0

    def see(self, rec: object) -> None:
        if isinstance(rec, SpecThresholdChanged) and self.switched_at is None:
            self.switched_at = rec.step


class SlowExecutor(InProcessExecutor):
    costs = Costs()

    def execute(self, plan: StepPlan) -> StepResult:
        time.sleep(self.costs.delay(plan))
        return super().execute(plan)


def serve(engine: Engine, waves: list[int]) -> None:
    """Waves of requests, each once the previous is down to two: half greedy with a frequency
    penalty over a prompt of repeats (the tiny model's text then runs in threes, so n-gram
    drafts fail at each change and are accepted in between: K drops and rises), half mixed."""
    i = 0
    pending = list(waves)
    while pending or engine.has_work():
        if pending and len(engine.requests) <= 2:
            for _ in range(pending.pop(0)):
                prompt = [7, 50 + i % 9, 51, 52, 7, 53, 54, 55, 7, 56, 57, 58, 7]
                params = SamplingParams(temperature=0.0, frequency_penalty=0.3, max_tokens=40)
                engine.add_request(prompt, params if i % 2 else mixed_params(i, 24))
                i += 1
        engine.step()


@pytest.fixture(scope="module")
def auto_log(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("auto") / "run.memlog"
    isolate_heap()
    recorder = open_recorder(path)
    assert recorder is not None
    SlowExecutor.costs = costs = Costs()
    engine = Engine(CFG, SlowExecutor, sinks=[recorder, costs.see])
    try:
        serve(engine, WAVES)
    finally:
        engine.shutdown()
        recorder.close()
    return path


def test_the_run_switched_speculation_off_and_on_and_changed_k(auto_log):
    rec = load(auto_log)
    thresholds = [r.threshold for r in rec.records if isinstance(r, SpecThresholdChanged)]
    assert 4 in thresholds, thresholds
    assert thresholds[thresholds.index(4) :].count(None) >= 1, thresholds
    kinds = [r.kind for r in rec.records if isinstance(r, StepFinished)]
    assert {"spec", "no_spec"} <= set(kinds)
    changes = [r for r in rec.records if isinstance(r, DraftLengthChanged)]
    assert any(c.new < c.old for c in changes) and any(c.new > c.old for c in changes)
    assert all(1 <= c.new <= CFG.num_speculative_tokens for c in changes)


def test_replay_applies_the_recorded_threshold_and_reproduces_every_record(auto_log):
    rec = load(auto_log)
    isolate_heap()
    run = replay(rec)
    assert replayable_bytes(run.derived) == replayable_bytes(rec.derived)
    assert not run.skipped and run.inputs_shifted == 0


def test_a_replay_that_ignores_the_recorded_threshold_diverges(auto_log):
    rec = load(auto_log)
    blind = Recording(
        rec.path,
        rec.header,
        [r for r in rec.records if not isinstance(r, SpecThresholdChanged)],
        rec.problems,
    )
    isolate_heap()
    run = replay(blind)
    result = compare(rec.derived, run.derived)
    assert not result.is_identical
    first = result.first
    assert first is not None and first.event in ("StepPlanned", "StateExited", "StateEntered")


def test_inspect_shows_the_threshold_and_draft_length_changes(auto_log, capsys):
    from memstep.cli.main import main

    rec = load(auto_log)
    thresholds = [r for r in rec.records if isinstance(r, SpecThresholdChanged)]
    changes = [r for r in rec.records if isinstance(r, DraftLengthChanged)]
    assert main(["inspect", str(auto_log)]) == 0
    text = capsys.readouterr().out
    first = thresholds[0]
    shown = (
        f"step {first.step} -> {'none' if first.threshold is None else f'below {first.threshold}'}"
    )
    assert f"speculation threshold changes: {shown}" in text
    dropped = sum(c.new < c.old for c in changes)
    raised = len(changes) - dropped
    assert f"draft length changes: {dropped} dropped, {raised} raised" in text


def test_a_replay_that_ignores_the_recorded_probe_gaps_diverges(auto_log):
    """The probes' first gaps after a change come from the rates it was decided on (wall
    time): the log carries them, and a replay that takes the period instead probes elsewhere."""
    rec = load(auto_log)
    changes = [r for r in rec.records if isinstance(r, SpecThresholdChanged)]
    assert any(gap > PROBE_PERIOD for r in changes for _, gap in r.probe_gaps), changes
    records = [
        attrs.evolve(r, probe_gaps=[]) if isinstance(r, SpecThresholdChanged) else r
        for r in rec.records
    ]
    isolate_heap()
    run = replay(Recording(rec.path, rec.header, records, rec.problems))
    result = compare(rec.derived, run.derived)
    assert not result.is_identical
    first = result.first
    assert first is not None and first.event in ("StepPlanned", "StateExited", "StateEntered")
