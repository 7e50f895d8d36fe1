"""Stretch analysis from records: clean runs pass, growth or an unreleased ledger fails."""

from __future__ import annotations

from memstep.cli.scenarios import verdicts
from memstep.events.stretches import stretches
from memstep.events.types import LedgerEntry, MemoryReport, StateEntered, StateExited, StepFinished

BUF = [LedgerEntry("spec", "draft_tokens", 256, 0)]


def step(n: int, kind: str, live: int) -> StepFinished:
    return StepFinished(n, kind, [], 0, 0, MemoryReport(live, live, 3, 0, 0, 1))


def run(no_spec_live=(100, 100), exit_ledger=()) -> list[object]:
    return [
        StateEntered(0, "spec", 256, BUF),
        step(0, "spec", 100),
        step(1, "spec", 100),
        StateExited(2, "spec", 256, list(exit_ledger)),
        StateEntered(2, "no_spec", 0, list(exit_ledger)),
        step(2, "no_spec", no_spec_live[0]),
        step(3, "no_spec", no_spec_live[1]),
    ]


def test_clean_run():
    parts = stretches(run())
    assert [(s.kind, s.num_steps, s.is_clean) for s in parts] == [
        ("spec", 2, True),
        ("no_spec", 2, True),
    ]
    assert all(v.verdict == "ok" for v in verdicts(run()))


def test_growth_within_a_stretch_is_a_leak():
    rows = {v.kind: v for v in verdicts(run(no_spec_live=(100, 164)))}
    assert rows["no_spec"].verdict == "LEAK" and rows["no_spec"].growth == 64
    assert rows["spec"].verdict == "ok"


def test_buffer_left_in_the_ledger_after_exit_is_a_leak():
    rows = {v.kind: v for v in verdicts(run(exit_ledger=BUF))}
    assert rows["spec"].verdict == "LEAK"
