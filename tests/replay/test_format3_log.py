"""A log of format 3, written before the plan and the log carried sampling parameters as records,
reads and replays identically: the same tokens, transitions, ledger and memory reports."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from replay_helpers import isolate_heap

from memstep.events.log import read_log
from memstep.events.sampling_params import SamplingParams
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


def test_params_as_a_plain_map_read_only_in_a_log_before_format_4(tmp_path: Path):
    """Before format 4 a request's params were a plain map, which the reader makes the record;
    the same bytes under format 4 are damage (each such record undecodable), not read."""
    _, records, problems = read_log(FORMAT_3_LOG)
    added = [r for r in records if isinstance(r, RequestAdded)]
    assert not problems and all(type(r.params) is SamplingParams for r in added)
    assert added[5].params.guided_choice == ("red", "green", "blue")
    data = bytearray(FORMAT_3_LOG.read_bytes())
    data[8:10] = struct.pack("<H", 4)  # the version after the magic
    (tmp_path / "as4.memlog").write_bytes(data)
    with pytest.warns(UserWarning, match="undecodable"):
        _, records, problems = read_log(tmp_path / "as4.memlog")
    assert not any(isinstance(r, RequestAdded) for r in records)
    assert len(problems) == len(added) and all("RequestAdded.params" in p.message for p in problems)
