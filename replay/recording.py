"""A recorded event log read back for replay, inspection and plots.

`load` reads every part of a (possibly rotated) log and keeps what was intact: a torn or corrupt
tail is not an error here, it is `Recording.problem`, reported by whoever shows the log.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import attrs

from memstep.events.log import LogFormatError, LogProblem, PathLike, read_log
from memstep.events.types import EngineStarted, PhaseChanged, is_input

_HIGHLIGHTS = ("model", "dtype", "max_num_seqs", "max_num_batched_tokens", "speculative_method")
_SPEC_HIGHLIGHTS = ("num_speculative_tokens", "speculative_disable_by_batch_size")


@attrs.frozen
class Recording:
    """The header, every intact record in order, and why reading stopped early (or None)."""

    path: Path
    header: dict[str, Any]
    records: list[object]
    problem: LogProblem | None

    @property
    def config(self) -> dict[str, Any]:
        """The engine config as `EngineConfig.to_dict()` wrote it."""
        return self.header["config"]

    @property
    def model_identity(self) -> str:
        return self.header["model_identity"]

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
        return [r for r in self.records if not is_input(r)]

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
        return self.problem is None and self.was_shut_down

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
        """One line saying where and why the log is damaged or cut short; None when complete."""
        p = self.problem
        if p is not None:
            file, _, why = p.message.partition(": ")  # LogReader names the (part) file first
            return (
                f"log damaged: {p.kind} record at byte {p.offset} of {file} ({why}); kept the "
                f"intact prefix of {len(self.records)} records, up to step {self.last_step}"
            )
        if not self.was_shut_down:
            return (
                f"log ends at step {self.last_step} without an engine shutdown "
                "(the engine crashed, or the log is still being written)"
            )
        return None


def load(path: PathLike) -> Recording:
    """Read the log at `path` (and its rotated parts); raise LogFormatError if it is not one.

    The engine's config and model identity come from the header, or, for logs whose header lacks
    them, from the EngineStarted record that begins every engine log.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the problem is kept and reported by the caller
        header, records, problem = read_log(path)
    started = records[0] if records and isinstance(records[0], EngineStarted) else None
    if started is not None:
        header = {"config": started.config, "model_identity": started.model_identity, **header}
    if type(header.get("config")) is not dict or type(header.get("model_identity")) is not str:
        raise LogFormatError(f"{path}: neither header nor first record has the engine config")
    return Recording(Path(path), header, records, problem)
