"""Real-model logs replay byte for byte: 211 mixed requests with speculation toggling and aborts,
and a run with the speculative worker's leak planted."""

from __future__ import annotations

from replay_helpers import isolate_heap

from memstep.events.types import (
    LeakSuspected,
    RequestAborted,
    RequestAdded,
    RequestFinished,
    StateEntered,
    StepFinished,
)
from memstep.replay.compare import replayable_bytes
from memstep.replay.recording import load
from memstep.replay.replayer import replay
from memstep.replay.report import build_report


def test_the_recorded_run_has_what_it_claims(smol_log):
    rec = load(smol_log.path)
    assert rec.is_complete
    added = [r for r in rec.records if isinstance(r, RequestAdded)]
    assert len(added) == smol_log.workload.num_requests >= 200
    params = [r.params for r in added]
    assert any(p.is_greedy for p in params)
    assert any(p.top_p < 1 for p in params) and any(p.top_k for p in params)
    assert any(p.min_p for p in params) and any(p.has_penalties for p in params)
    assert any(p.stop for p in params) and len({p.seed for p in params}) > 100
    assert any(p.logit_bias and p.min_tokens for p in params)
    aborted = [r.request_id for r in rec.records if isinstance(r, RequestAborted)]
    assert aborted == smol_log.workload.aborted and len(aborted) >= 5
    reasons = {r.reason for r in rec.records if isinstance(r, RequestFinished)}
    assert reasons == {"stop", "length", "abort"}
    kinds = [r.kind for r in rec.records if isinstance(r, StepFinished)]
    changes = {(a, b) for a, b in zip(kinds, kinds[1:], strict=False) if a != b}
    assert changes == {("no_spec", "spec"), ("spec", "no_spec")}
    entered = [r for r in rec.records if isinstance(r, StateEntered) and r.kind == "spec"]
    assert len(entered) >= 5 and all(e.bytes_claimed > 0 and e.ledger for e in entered)
    assert sum(r.num_proposed for r in rec.records if isinstance(r, StepFinished)) > 0


def test_replay_reproduces_every_derived_record_byte_for_byte(smol_log):
    rec = load(smol_log.path)
    isolate_heap()
    run = replay(rec)
    recorded = replayable_bytes(rec.derived)
    replayed = replayable_bytes(run.derived)
    report = build_report(rec, run)
    assert len(recorded) > 400
    # every token, transition, ledger line and memory report
    assert replayed == recorded, report.to_text()
    assert report.exit_code == 0 and report.comparison.num_compared == len(recorded)
    assert not report.warnings and not run.skipped and run.inputs_shifted == 0


def test_planted_leak_replays_with_the_same_report_at_the_same_step(leak_log):
    rec = load(leak_log.path)
    leaks = [r for r in rec.records if isinstance(r, LeakSuspected)]
    assert leaks and leaks[0].kind == "no_spec" and leaks[0].what == "live_growth"
    steps = [r for r in rec.records if isinstance(r, StepFinished)]
    base = steps[0].memory.live_bytes
    first_growth = next(s.step for s in steps if s.memory.live_bytes > base)
    # the window of the first rise the detector counts, after its warm-up window
    assert first_growth <= leaks[0].step < first_growth + 24
    isolate_heap()
    run = replay(rec)
    assert [r for r in run.derived if isinstance(r, LeakSuspected)] == leaks
    assert [i for i, r in enumerate(run.derived) if isinstance(r, LeakSuspected)] == [
        i for i, r in enumerate(rec.derived) if isinstance(r, LeakSuspected)
    ]
    assert build_report(rec, run).comparison.is_identical
