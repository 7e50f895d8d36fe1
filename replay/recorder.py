"""Recording an engine's life to its event log: the sink, and the `--record` flags.

Pass a `Recorder` in the engine's `sinks`; the engine emits `EngineStarted` first, from its
constructor, and the recorder opens the log with a header built from it (memstep version, full
config, model identity), so a log exists from the first record on.  Records are appended as they
come and handed to the operating system once per step, on `StepFinished` (and on the rare phase
changes and leak reports), which keeps recording cheap and a crash costs at most one step.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import time
from pathlib import Path
from typing import Any

from memstep.core.config import ConfigError
from memstep.events.log import ClosedOnExit, LogWriter, PathLike
from memstep.events.types import EngineStarted, LeakSuspected, PhaseChanged, StepFinished

DEFAULT_RECORD_DIR = Path("memstep-logs")  # relative to the working directory
DEFAULT_RECORD_PATH = f"{DEFAULT_RECORD_DIR}/memstep-{{time}}.memlog"  # {time}: the start time
DEFAULT_KEEP = 20  # logs kept in DEFAULT_RECORD_DIR: a new one removes the oldest beyond it
DEFAULT_ROTATE_BYTES = 1 << 30
_FLUSH_ON = (StepFinished, LeakSuspected, PhaseChanged)
_SIZE = re.compile(r"^(\d+)\s*([kmgt]?)i?b?$", re.IGNORECASE)


class RecordPathTaken(ConfigError):
    """The log path exists already; a log is never overwritten."""


class Recorder(ClosedOnExit):
    """A sink that writes every engine record to a `LogWriter` at `path`.

    Owns the writer, which it opens on the first record (it must be `EngineStarted`): the header
    carries that record's config and model identity.  Call `close` after `engine.shutdown()`, or
    use the recorder as a context manager.
    """

    def __init__(self, path: PathLike, rotate_bytes: int | None = None, header: dict | None = None):
        self.path = Path(path)
        self.rotate_bytes = rotate_bytes
        self.extra_header = header or {}  # e.g. `resumed_from`: the log a resumed server read
        self.writer: LogWriter | None = None

    def __call__(self, rec: object) -> None:
        if self.writer is None:
            header = {**header_for(rec), **self.extra_header}
            self.writer = LogWriter(self.path, header, self.rotate_bytes)
        self.writer.append(rec)
        if isinstance(rec, _FLUSH_ON):
            self.writer.flush()

    @property
    def parts(self) -> list[Path]:
        """The files written so far (more than one once the log has rotated)."""
        return [] if self.writer is None else self.writer.parts

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def header_for(rec: object) -> dict:
    """The log header for an engine that started with `rec` (its first record)."""
    if not isinstance(rec, EngineStarted):
        raise ValueError(f"a log must begin with EngineStarted, got {type(rec).__name__}")
    return {"config": rec.config, "model_identity": rec.model_identity}


# --- command line --------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Bytes from `1073741824`, `512M`, `1GiB`, ...; 0 means no rotation."""
    match = _SIZE.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 1G)")
    number, unit = match.groups()
    return int(number) * 1024 ** " kmgt".index(unit.lower() or " ")


def add_record_arguments(
    p: argparse.ArgumentParser, by_default: bool = False, group: Any = None, more: Any = None
) -> None:
    """`--record PATH` (with `by_default`, also `--no-record`) in `group`, and
    `--record-rotate-bytes N` and `--record-keep N` in `more`; both default to an "event log"
    group of `p`."""
    g = group or more or p.add_argument_group("event log")
    default = DEFAULT_RECORD_PATH if by_default else None
    where = f" (default: {DEFAULT_RECORD_DIR}/)" if by_default else ""
    g.add_argument(
        "--record", metavar="PATH", default=default,
        help=f"the event log ({{time}}: start time){where}",
    )  # fmt: skip
    if by_default:
        g.add_argument(
            "--no-record", dest="record", action="store_const", const=None, help="record nothing"
        )
    g = more or g
    g.add_argument(
        "--record-rotate-bytes", type=parse_size, default=DEFAULT_ROTATE_BYTES, metavar="N",
        help="start a new part (PATH.1, PATH.2, ...) past this size; 0 never rotates",
    )  # fmt: skip
    g.add_argument(
        "--record-keep", type=int, default=DEFAULT_KEEP, metavar="N",
        help=f"logs kept in {DEFAULT_RECORD_DIR}/: older ones are removed",
    )  # fmt: skip


def prune(directory: Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` - 1 logs (with their parts) of `directory`, making room
    for one more; the removed files.  Names hold the start time, so name order is age order."""
    logs = sorted(directory.glob("memstep-*.memlog"))
    gone = []
    for log in logs[: max(0, len(logs) - max(keep - 1, 0))]:
        for part in [log, *directory.glob(glob.escape(log.name) + ".*")]:
            part.unlink(missing_ok=True)
            gone.append(part)
    return gone


def open_recorder(
    args_or_path: argparse.Namespace | PathLike | None,
    rotate_bytes: int | None = None,
    header: dict | None = None,
) -> Recorder | None:
    """A recorder for the parsed `--record` flags (or a path), None when not recording.

    Refuses (RecordPathTaken, a ConfigError) a path that exists, before any model is loaded.
    """
    keep = DEFAULT_KEEP
    if isinstance(args_or_path, argparse.Namespace):
        keep = getattr(args_or_path, "record_keep", DEFAULT_KEEP)
        if getattr(args_or_path, "config_file", None):  # `--config FILE.yaml`, as read
            header = {**(header or {}), "config_file": args_or_path.config_file}
        rotate_bytes = args_or_path.record_rotate_bytes
        args_or_path = args_or_path.record
    if args_or_path is None:
        return None
    path = Path(os.fspath(args_or_path).replace("{time}", time.strftime("%Y%m%d-%H%M%S")))
    if path.parent == DEFAULT_RECORD_DIR:  # the default directory: made, and kept small
        path.parent.mkdir(exist_ok=True)
        prune(path.parent, keep)
    if path.exists():
        raise RecordPathTaken(f"{path} exists; a log is never overwritten, choose another path")
    return Recorder(path, rotate_bytes or None, header)
