"""The comparison on hand-made records: what counts as different, and how it is counted."""

from __future__ import annotations

import attrs

from memstep.events.types import (
    LedgerEntry,
    MemoryReport,
    RequestFinished,
    StateEntered,
    StepFinished,
    StepPlanned,
)
from memstep.replay.compare import compare, differences

MEM = MemoryReport(1000, 1000, 3, 0, 256, 2)


def steps(n: int) -> list[object]:
    out: list[object] = []
    for step in range(n):
        out.append(StepPlanned(step, "no_spec", [["a", 1], ["b", 1]], 2))
        out.append(StepFinished(step, "no_spec", [["a", [step]], ["b", [7]]], 0, 0, MEM))
    return out


def test_identical_streams():
    c = compare(steps(3), steps(3))
    assert c.is_identical and c.num_compared == 6 and c.num_bad == 0


def test_a_float_is_not_an_int_and_lengths_count():
    assert list(differences({"x": 1}, {"x": 1.0})) == [(("x",), 1, 1.0)]
    assert list(differences([1, 2], [1, 2, 3])) == [(("len",), 2, 3)]
    assert list(differences({"a": [True]}, {"a": [1]})) == [(("a", 0), True, 1)]


def test_first_divergence_names_step_field_and_request():
    replayed = steps(4)
    replayed[5] = attrs.evolve(replayed[5], sampled=[["a", [2]], ["b", [8]]])
    replayed[7] = attrs.evolve(replayed[7], memory=attrs.evolve(MEM, live_bytes=1001))
    c = compare(steps(4), replayed)
    assert c.first is not None
    assert (c.first.step, c.first.event, c.first.field) == (2, "StepFinished", "sampled[1][1][0]")
    assert (c.first.recorded, c.first.replayed, c.first.request_id) == (7, 8, "b")
    assert c.num_differing == 2 and c.num_missing == c.num_extra == 0
    assert c.fields == {"StepFinished.sampled": 1, "StepFinished.memory.live_bytes": 1}
    assert "step 2, StepFinished, field sampled[1][1][0] (request b)" in c.first.describe()


def test_ledger_bytes_are_compared():
    entry = LedgerEntry("spec", "draft_probs", 4096, 3)
    rec = [StateEntered(3, "spec", 4096, [entry])]
    rep = [StateEntered(3, "spec", 4096, [attrs.evolve(entry, nbytes=4352)])]
    c = compare(rec, rep)
    assert c.first is not None and c.first.field == "ledger[0].nbytes"
    assert (c.first.recorded, c.first.replayed) == (4096, 4352)


def test_a_shifted_record_counts_once_not_for_everything_after_it():
    done = RequestFinished(1, "a", "stop", 3, 2)
    recorded = steps(3)
    replayed = [*recorded[:3], done, *recorded[3:]]
    c = compare(recorded, replayed)
    assert c.first is not None and c.first.index == 3 and c.first.replayed == "RequestFinished"
    assert (c.num_differing, c.num_missing, c.num_extra) == (0, 0, 1)
    c = compare(replayed, recorded[:-1])
    assert (c.num_differing, c.num_missing, c.num_extra) == (0, 2, 0)
