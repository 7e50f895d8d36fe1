"""Stretches: runs of consecutive serving steps of one kind, with memory at both ends.

Computed from records alone, so a live run, a scenario and a recorded log give the same answer.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from memstep.events.types import LedgerEntry, StateEntered, StateExited, StepFinished


@attrs.frozen
class Stretch:
    kind: str
    first_step: int
    last_step: int
    num_steps: int
    live_start: int  # live bytes after the first step of the stretch
    live_end: int  # live bytes after the last step
    growth: int  # live_end - live_start
    segments_start: int
    segments_end: int
    ledger_start: list[LedgerEntry]  # before the kind's enter hook claimed its buffers
    ledger_end: list[LedgerEntry]  # after its exit hook released them (if it has exited)

    @property
    def is_clean(self) -> bool:
        return (
            self.growth == 0
            and self.segments_end == self.segments_start
            and self.ledger_end == self.ledger_start
        )


def stretches(records: Iterable[object]) -> list[Stretch]:
    """Split the serving steps into stretches of one kind."""
    runs: list[list[StepFinished]] = []
    ledgers: list[list[list[LedgerEntry]]] = []  # per run: [before entry, after exit]
    current: list[LedgerEntry] = []  # the ledger as the last transition left it
    before_entry: list[LedgerEntry] = []
    for rec in records:
        if isinstance(rec, StateEntered):
            before_entry, current = current, rec.ledger
        elif isinstance(rec, StateExited):
            current = rec.ledger
            if runs and runs[-1][0].kind == rec.kind:
                ledgers[-1][1] = rec.ledger
        elif isinstance(rec, StepFinished):
            if not runs or runs[-1][0].kind != rec.kind:
                runs.append([])
                ledgers.append([before_entry, before_entry])
            runs[-1].append(rec)
    out = []
    for run, (start_ledger, end_ledger) in zip(runs, ledgers, strict=True):
        first, last = run[0], run[-1]
        live_start, live_end = first.memory.live_bytes, last.memory.live_bytes
        out.append(
            Stretch(
                first.kind,
                first.step,
                last.step,
                len(run),
                live_start,
                live_end,
                live_end - live_start,
                first.memory.num_segments,
                last.memory.num_segments,
                start_ledger,
                end_ledger,
            )
        )
    return out
