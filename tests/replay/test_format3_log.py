"""A log of format 3, written before the plan and the log carried sampling parameters as records,
reads and replays identically: the same tokens, transitions, ledger and memory reports."""

from __future__ import annotations

from pathlib import Path

from replay_helpers import isolate_heap

from memstep.events.types import RequestAdded, RequestPreempted, StepFinished, StepPlanned
from memstep.replay.compare import replayable_bytes
from memstep.replay.recording import load
from memstep.replay.replayer import replay
from memstep.replay.report import build_report

# SmolLM2, seed 7: 8 requests (mixed sampling, a guided choice with prompt logprobs, a prefix
# hit, a chunked prompt, a preemption, spec toggling), written by memstep 445e001
FORMAT_3_LOG = Path(__file__).parent / "data" / "format3.memlog"


def tokens(records: list[object]) -> list[list]:
    """Each step's [[request_id, [token ids]], ...]."""
    return [r.sampled for r in records if isinstance(r, StepFinished)]


def test_a_format_3_log_replays_the_same_tokens_and_records():
    rec = load(FORMAT_3_LOG)
    assert rec.format_version == 3 and rec.is_complete
    assert len([r for r in rec.inputs if isinstance(r, RequestAdded)]) == 8
    assert any(isinstance(r, RequestPreempted) for r in rec.derived)
    assert any(r.cached for r in rec.derived if isinstance(r, StepPlanned))
    isolate_heap()
    run = replay(rec)
    report = build_report(rec, run)
    assert tokens(run.derived) == tokens(rec.derived)
    assert sum(len(ids) for step in tokens(rec.derived) for _, ids in step) > 30
    assert replayable_bytes(run.derived) == replayable_bytes(rec.derived), report.to_text()
    assert report.exit_code == 0 and not run.skipped
