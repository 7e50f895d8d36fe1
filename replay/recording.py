"""A recorded event log read back for replay, inspection and plots.

`load` reads every part of a (possibly rotated) log and keeps what was intact: a torn or corrupt
tail, or a corrupt stretch mid-log, is not an error here, it is in `Recording.problems`, reported
by whoever shows the log.  So is a `RecordsLost` gap record (records a server could not write,
with `--on-log-error continue`): a problem of kind "lost" at that record, a gap like corruption.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import attrs

from memstep.events.log import LogFormatError, LogProblem, PathLike, read_log
from memstep.events.types import (
    EngineStarted,
    PhaseChanged,
    RecordsLost,
    is_derived,
    is_input,
)

_HIGHLIGHTS = ("model", "dtype", "max_num_seqs", "max_num_batched_tokens", "speculative_method")
_SPEC_HIGHLIGHTS = ("num_speculative_tokens", "speculative_disable_by_batch_size")


@attrs.frozen
class Recording:
    """The header, every intact record in order, and each damaged stretch of the file."""

    path: Path
    header: dict[str, Any]
    records: list[object]
    problems: list[LogProblem]

    @property
    def config(self) -> dict[str, Any]:
        """The engine config as `EngineConfig.to_dict()` wrote it."""
        return self.header["config"]

    @property
    def model_identity(self) -> str:
        return self.header["model_identity"]

    @property
    def format_version(self) -> int:
        """The log format it was written in (`events.log.FORMAT_VERSION` of its writer)."""
        return int(self.header.get("format_version", 1))

    @property
    def memstep_version(self) -> str | None:
        return self.header.get("memstep_version")

    @property
    def inputs(self) -> list[object]:
        """RequestAdded and RequestAborted records, in the order they arrived."""
        return [r for r in self.records if is_input(r) and not isinstance(r, EngineStarted)]

    @property
    def derived(self) -> list[object]:
        """Everything the engine derived from its inputs, in the order it was emitted."""
        return [r for r in self.records if is_derived(r)]

    @property
    def last_step(self) -> int:
        """The highest step any record mentions (0 for a log with no steps)."""
        return max((getattr(r, "step", 0) for r in self.records), default=0)

    @property
    def was_shut_down(self) -> bool:
        return any(isinstance(r, PhaseChanged) and r.new == "shutdown" for r in self.records)

    @property
    def is_complete(self) -> bool:
        """Intact and ending with the engine's shutdown: the whole life of an engine."""
        return not self.problems and self.was_shut_down

    @property
    def gaps(self) -> list[LogProblem]:
        """Damage with intact records after it: corruption, records lost mid-log."""
        return [p for p in self.problems if p.index < len(self.records)]

    @property
    def is_corrupt(self) -> bool:
        return bool(self.gaps)

    def before_damage(self) -> Recording:
        """The records before the first gap, as a log cut there: what replay can check exactly.

        A lost record may have been an input, so nothing after a gap can be replayed exactly.
        """
        if not self.gaps:
            return self
        gap = self.gaps[0]
        return attrs.evolve(self, records=self.records[: gap.index], problems=[gap])

    def highlights(self) -> str:
        """The config values that shape memory and step kinds, as `key=value` words."""
        cfg = self.config
        words = [f"{key}={cfg.get(key)}" for key in _HIGHLIGHTS]
        if cfg.get("speculative_method"):
            words += [f"{key}={cfg.get(key)}" for key in _SPEC_HIGHLIGHTS]
        if cfg.get("debug_plant_leak"):
            words.append(f"debug_plant_leak={cfg['debug_plant_leak']}")
        return " ".join(words)

    def describe_problem(self) -> str | None:
        """Where and why the log is damaged or cut short, one clause per damage; None if whole."""
        if self.problems:
            return "; ".join(self._describe(p) for p in self.problems)
        if not self.was_shut_down:
            return (
                f"log ends at step {self.last_step} without an engine shutdown "
                "(the engine crashed, or the log is still being written)"
            )
        return None

    def _describe(self, p: LogProblem) -> str:
        if p.kind == "lost":
            return f"log gap: {p.message}; {len(self.records) - p.index - 1} records after it"
        where = f"{p.kind} record at byte {p.offset} of {p.path} ({p.message})"
        if p.index == len(self.records):
            return (
                f"log damaged: {where}; kept the {p.index} records before it, "
                f"up to step {self.last_step}"
            )
        before = _step_of(self.records[p.index - 1]) if p.index else 0
        return (
            f"log corrupt: {where}: bytes {p.offset}-{p.end} ({p.num_bytes} bytes) lost between "
            f"step {before} and step {_step_of(self.records[p.index])}; "
            f"{len(self.records) - p.index} records recovered after it"
        )


def _step_of(rec: object) -> int:
    return getattr(rec, "step", 0)


def load(path: PathLike) -> Recording:
    """Read the log at `path` (and its rotated parts); raise LogFormatError if it is not one.

    The engine's config and model identity come from the header, or, for logs whose header lacks
    them, from the EngineStarted record that begins every engine log.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the problem is kept and reported by the caller
        header, records, problems = read_log(path)
    started = records[0] if records and isinstance(records[0], EngineStarted) else None
    if started is not None:
        header = {"config": started.config, "model_identity": started.model_identity, **header}
    if type(header.get("config")) is not dict or type(header.get("model_identity")) is not str:
        raise LogFormatError(f"{path}: neither header nor first record has the engine config")
    lost = [
        _gap(Path(path), i, rec) for i, rec in enumerate(records) if isinstance(rec, RecordsLost)
    ]
    problems = sorted([*problems, *lost], key=lambda p: p.index)
    return Recording(Path(path), header, records, problems)


def _gap(path: Path, index: int, rec: RecordsLost) -> LogProblem:
    message = (
        f"{rec.num_records} records of steps {rec.first_step}-{rec.last_step} were never "
        f"written ({rec.reason})"
    )
    return LogProblem(path, 0, 0, "lost", message, index)
