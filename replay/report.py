"""The verdict of one replay: identical, the first divergence, or (what-if) what changed.

Built from the recording and the replay run; rendered as text for people or as JSON.
"""

from __future__ import annotations

from typing import Any

import attrs

from memstep.events.types import in_format, is_input
from memstep.events.version import VERSION
from memstep.replay.compare import Comparison, compare
from memstep.replay.recording import Recording
from memstep.replay.replayer import ReplayRun
from memstep.replay.text_table import render
from memstep.replay.whatif import WhatIf, what_if

EXIT_DIVERGED = 1
EXIT_CORRUPT = 3  # records lost mid-log: only the records before the first gap were checked


@attrs.frozen
class ReplayReport:
    """Everything `memstep replay` says about one replay; `exit_code` is its verdict."""

    log: str
    num_records: int  # intact records in the log
    num_inputs: int
    problem: str | None  # where and why the log is damaged or cut short
    is_corrupt: bool  # records lost mid-log, with intact records after them
    num_unchecked: int  # records recovered after the first gap: neither replayed nor compared
    num_unchecked_inputs: int
    overrides: dict[str, Any]
    warnings: list[str]
    comparison: Comparison
    num_beyond_end: int  # replayed records past the end of a damaged/unfinished log
    skipped: list[str]
    inputs_shifted: int
    what_if: WhatIf | None  # only for runs with overrides
    inputs_refused: int = 0  # in a plain replay, each a log input no engine took: not identical

    @property
    def exit_code(self) -> int:
        """1 on a divergence (a what-if run reports instead of failing), else 3 for a corrupt
        log (what was checked matched, but not all of it could be), else 0."""
        if self.what_if is None and not self.is_identical:
            return EXIT_DIVERGED
        return EXIT_CORRUPT if self.is_corrupt else 0

    def to_dict(self) -> dict[str, Any]:
        data = attrs.asdict(self)
        data["identical"] = self.is_identical
        data["exit_code"] = self.exit_code
        return data

    @property
    def is_identical(self) -> bool:
        """Every derived record reproduced, from the inputs as recorded (a plain replay whose
        engine refused a recorded input replayed other inputs than the recorded run took)."""
        plain_refused = self.what_if is None and self.inputs_refused > 0
        return self.comparison.is_identical and not plain_refused

    def to_text(self) -> str:
        lines = [f"replay of {self.log}: {self.num_records} records, {self.num_inputs} inputs"]
        lines += [f"! {line}" for line in [self.problem, *self.warnings] if line]
        if self.is_corrupt:
            lines.append(
                f"! corrupt log: only the records before the first gap were replayed; "
                f"{self.num_unchecked} records recovered after it ({self.num_unchecked_inputs} "
                "inputs) were not checked: a lost record may have been an input"
            )
        if self.num_beyond_end:
            lines.append(f"! {self.num_beyond_end} replayed records past the end: not compared")
        lines += [f"! skipped input: {line}" for line in self.skipped]
        if self.inputs_shifted:
            lines.append(f"! {self.inputs_shifted} inputs applied before their recorded step")
        lines.append(self._verdict())
        if self.what_if is not None:
            lines.append(self._what_if_text(self.what_if))
        return "\n".join(lines)

    def _verdict(self) -> str:
        c = self.comparison
        if c.first is None and not self.is_identical:
            return (
                f"NOT AS RECORDED: the replayed engine refused {self.inputs_refused} of the log's "
                "inputs (skipped above), which the recorded engine took: the log's inputs were "
                "duplicated or edited"
            )
        if c.first is None and c.num_compared == 0:
            return "nothing to compare: the log holds no derived records"
        if c.first is None:
            return (
                f"identical: {c.num_compared} derived records match field for field "
                "(tokens, transitions, arena ledger, memory reports, leak reports)"
                + (" before the gap; the rest of the log is unchecked" if self.is_corrupt else "")
            )
        word = "differs" if self.what_if is not None else "DIVERGED"
        lines = [
            f"{word} first at {c.first.describe()}",
            f"  {c.num_bad} derived records differ: {c.num_differing} of {c.num_compared} "
            f"matched records, {c.num_missing} missing from the replay, {c.num_extra} extra",
        ]
        if c.fields:
            fields = ", ".join(f"{name} x{n}" for name, n in list(c.fields.items())[:8])
            lines.append(f"  differing fields: {fields}")
        return "\n".join(lines)

    def _what_if_text(self, w: WhatIf) -> str:
        sets = " ".join(f"{k}={v}" for k, v in self.overrides.items())
        rows = [c.row() for c in w.changes]
        lines = [
            f"what-if replay with {sets}: {w.num_changed} figures changed",
            render(["figure", "recorded", "replayed", "change"], rows),
        ]
        for label, leaks in (("recorded", w.leaks_recorded), ("replayed", w.leaks_replayed)):
            lines += [f"  leak ({label}): {leak}" for leak in leaks]
        return "\n".join(lines)


def build_report(
    recording: Recording, run: ReplayRun, overrides: dict[str, Any] | None = None
) -> ReplayReport:
    """Compare `run` with `recording`; an unfinished log is compared only as far as it goes, a
    corrupt one only up to its first gap."""
    checked = recording.before_damage()
    unchecked = recording.records[len(checked.records) :]
    recorded = checked.derived
    # a log of an older format holds none of the records added since: they are not compared
    replayed = [r for r in run.derived if in_format(r, recording.format_version)]
    beyond = 0
    if run.stopped_at_step is not None and len(replayed) > len(recorded):
        beyond = len(replayed) - len(recorded)
        replayed = replayed[: len(recorded)]
    return ReplayReport(
        log=str(recording.path),
        num_records=len(recording.records),
        num_inputs=len(recording.inputs),
        problem=recording.describe_problem(),
        is_corrupt=recording.is_corrupt,
        num_unchecked=len(unchecked),
        num_unchecked_inputs=sum(is_input(r) for r in unchecked),
        overrides=dict(overrides or {}),
        warnings=_warnings(recording, run),
        comparison=compare(recorded, replayed),
        num_beyond_end=beyond,
        skipped=run.skipped,
        inputs_shifted=run.inputs_shifted,
        inputs_refused=run.inputs_refused,
        what_if=what_if(recorded, replayed) if overrides else None,
    )


def _warnings(recording: Recording, run: ReplayRun) -> list[str]:
    out = []
    if run.model_identity != recording.model_identity:
        out.append(
            f"model differs: recorded {recording.model_identity}, replayed {run.model_identity}"
        )
    version = recording.memstep_version
    if version != VERSION:
        out.append(f"recorded with memstep {version}, replayed with {VERSION}")
    return out
