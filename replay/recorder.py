"""Recording an engine's life to its event log: the sink, and the `--record` flags.

Pass a `Recorder` in the engine's `sinks`; the engine emits `EngineStarted` first, from its
constructor, and the recorder opens the log with a header built from it (memstep version, full
config, model identity), so a log exists from the first record on.  Records are appended as they
come and handed to the operating system once per step, on `StepFinished` (and on the rare phase
changes and leak reports), which keeps recording cheap and a crash costs at most one step.

The record is a promise, as a database's commit is.  `fsync` says when written records reach
the disk: `step` (at every step's flush: a power loss costs nothing acknowledged), `interval` (at
most `FSYNC_INTERVAL_S` apart: a power loss costs up to a second; the default) or `never` (the
OS decides; a process crash still costs at most one step).  When a write fails (a full disk,
a file-size limit) `on_error` says what happens: `stop` holds every record from the failed one on
in memory and reports `failure`, and the server admits nothing and steps nothing (the held
records stay bounded) until `retry` writes them, so the log loses nothing; `continue` drops
records while writing fails and, once it works again, writes a `RecordsLost` gap record, which
`inspect` and `replay` report.  Without a server to stop (`generate`, `scenario`, tests) the
default is `raise`: the OSError ends the run, as any failed write would.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import time
from pathlib import Path
from typing import Any

import structlog

from memstep.core.config import ConfigError
from memstep.events.log import ClosedOnExit, LogWriter, PathLike
from memstep.events.types import (
    EngineStarted,
    LeakSuspected,
    PhaseChanged,
    RecordsLost,
    StepFinished,
)

log = structlog.get_logger("memstep.recorder")

DEFAULT_RECORD_DIR = Path("memstep-logs")  # relative to the working directory
DEFAULT_RECORD_PATH = f"{DEFAULT_RECORD_DIR}/memstep-{{time}}.memlog"  # {time}: the start time
DEFAULT_KEEP = 20  # logs kept in DEFAULT_RECORD_DIR: a new one removes the oldest beyond it
DEFAULT_ROTATE_BYTES = 1 << 30
_FLUSH_ON = (StepFinished, LeakSuspected, PhaseChanged)
ON_LOG_ERROR = ("stop", "continue")
LOG_FSYNC = ("step", "interval", "never")
FSYNC_INTERVAL_S = 1.0
RETRY_INTERVAL_S = 0.5  # a failing log is tried again this often, at most
_SIZE = re.compile(r"^(\d+)\s*([kmgt]?)i?b?$", re.IGNORECASE)


class RecordPathTaken(ConfigError):
    """The log path exists already; a log is never overwritten."""


class Recorder(ClosedOnExit):
    """A sink that writes every engine record to a `LogWriter` at `path`.

    Owns the writer, which it opens on the first record (it must be `EngineStarted`): the header
    carries that record's config and model identity.  Call `close` after `engine.shutdown()`, or
    use the recorder as a context manager.
    """

    def __init__(
        self,
        path: PathLike,
        rotate_bytes: int | None = None,
        header: dict | None = None,
        on_error: str = "raise",
        fsync: str = "never",
    ):
        if on_error not in (*ON_LOG_ERROR, "raise") or fsync not in LOG_FSYNC:
            raise ConfigError(f"on_error must be one of {ON_LOG_ERROR}, fsync one of {LOG_FSYNC}")
        self.path = Path(path)
        self.rotate_bytes = rotate_bytes
        self.extra_header = header or {}  # e.g. `resumed_from`: the log a resumed server read
        self.on_error = on_error
        self.fsync = fsync
        self.writer: LogWriter | None = None
        self.failure: str | None = None  # why the log cannot be written now; None: it can
        self.held: list[object] = []  # on_error stop: records not yet given to the writer
        self.unflushed: list[int] = []  # steps of the records appended since the last flush
        self.lost: list[int] = []  # on_error continue: steps of the records dropped
        self.last_fsync = self.last_retry = 0.0

    @property
    def blocks(self) -> bool:
        """The log cannot be written and nothing may happen unrecorded (`on_error` stop)."""
        return self.failure is not None and self.on_error == "stop"

    def __call__(self, rec: object) -> None:
        if self.writer is None:
            header = {**header_for(rec), **self.extra_header}
            self.writer = LogWriter(self.path, header, self.rotate_bytes)
        if self.failure is not None:
            self._while_failing(rec)
            return
        try:
            self.writer.append(rec)
        except OSError as exc:
            self._failed(exc, rec)
            return
        self.unflushed.append(_step(rec))
        if isinstance(rec, _FLUSH_ON):
            self._flush()

    def retry(self) -> bool:
        """Write what writing could not (at most every RETRY_INTERVAL_S); True once the log is
        writable again."""
        now = time.monotonic()
        if self.failure is None or self.writer is None:
            return self.failure is None
        if now - self.last_retry < RETRY_INTERVAL_S:
            return False
        self.last_retry = now
        try:
            self._write_held()
        except OSError as exc:
            self.failure = _describe(exc)
            return False
        log.warning("event log writable again", path=str(self.path))
        self.failure = None
        return True

    def _write_held(self) -> None:
        assert self.writer is not None
        if self.on_error == "continue":
            first, last = self.lost[0], self.lost[-1]
            gap = RecordsLost(last, len(self.lost), first, last, self.failure or "")
            try:
                self.writer.append(gap)
                self.writer.flush(fsync=True)
            except OSError:
                self.writer.discard()
                raise
            self.lost = []
            return
        self.writer.flush()  # what was buffered when writing failed
        while self.held:
            self.writer.append(self.held[0])
            self.held.pop(0)
        self.writer.flush(fsync=True)
        self.unflushed = []

    def _while_failing(self, rec: object) -> None:
        if self.on_error == "stop":
            self.held.append(rec)
        else:
            self.lost.append(_step(rec))
        if isinstance(rec, _FLUSH_ON):
            self.retry()

    def _flush(self) -> None:
        assert self.writer is not None
        now = time.monotonic()
        due = self.fsync == "step" or (
            self.fsync == "interval" and now - self.last_fsync >= FSYNC_INTERVAL_S
        )
        try:
            self.writer.flush(fsync=due)
        except OSError as exc:
            self._failed(exc, None)
            return
        self.unflushed = []
        if due:
            self.last_fsync = now

    def _failed(self, exc: OSError, rec: object | None) -> None:
        """Writing failed; `rec`, if given, was not appended."""
        assert self.writer is not None
        if self.on_error == "raise":
            raise exc
        self.failure = _describe(exc)
        self.last_retry = time.monotonic()
        log.error(
            "event log unwritable", path=str(self.path), error=self.failure, on_error=self.on_error
        )
        if self.on_error == "stop":
            self.held = [rec] if rec is not None else []
            return
        self.writer.discard()
        self.lost = self.unflushed + ([_step(rec)] if rec is not None else [])
        self.unflushed = []

    @property
    def parts(self) -> list[Path]:
        """The files written so far (more than one once the log has rotated)."""
        return [] if self.writer is None else self.writer.parts

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _step(rec: object) -> int:
    step = getattr(rec, "step", 0)
    return step if isinstance(step, int) else 0


def _describe(exc: OSError) -> str:
    return f"{exc.strerror or exc} (errno {exc.errno})" if exc.errno else str(exc)


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
    p: argparse.ArgumentParser,
    by_default: bool = False,
    group: Any = None,
    more: Any = None,
    durability: bool = False,
) -> None:
    """`--record PATH` (with `by_default`, also `--no-record`) in `group`, and
    `--record-rotate-bytes N` and `--record-keep N` in `more`; both default to an "event log"
    group of `p`. With `durability` (a server, which can stop admitting), `--on-log-error` and
    `--log-fsync` in `more`."""
    g = group or more or p.add_argument_group("event log")
    default = DEFAULT_RECORD_PATH if by_default else None
    where = f" (default: {DEFAULT_RECORD_DIR}/)" if by_default else ""
    g.add_argument(
        "--record",
        metavar="PATH",
        default=default,
        help=f"the event log ({{time}}: start time){where}",
    )
    if by_default:
        g.add_argument(
            "--no-record", dest="record", action="store_const", const=None, help="record nothing"
        )
    g = more or g
    if durability:
        _add_durability_arguments(g)
    g.add_argument(
        "--record-rotate-bytes",
        type=parse_size,
        default=DEFAULT_ROTATE_BYTES,
        metavar="N",
        help="start a new part (PATH.1, PATH.2, ...) past this size; 0 never rotates",
    )
    g.add_argument(
        "--record-keep",
        type=int,
        default=DEFAULT_KEEP,
        metavar="N",
        help=f"logs kept in {DEFAULT_RECORD_DIR}/: older ones are removed",
    )


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


def _add_durability_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--on-log-error",
        choices=ON_LOG_ERROR,
        default="stop",
        help="when the log cannot be written (a full disk): stop admits and runs nothing until "
        "it can (health 503 log_unwritable); continue serves on and writes a gap record once "
        "it can (docs/limits.md; default: %(default)s)",
    )
    g.add_argument(
        "--log-fsync",
        choices=LOG_FSYNC,
        default="interval",
        help=f"when records reach the disk: each step, every {FSYNC_INTERVAL_S:g} s, or when "
        "the OS decides (default: %(default)s)",
    )


def open_recorder(
    args_or_path: argparse.Namespace | PathLike | None,
    rotate_bytes: int | None = None,
    header: dict | None = None,
) -> Recorder | None:
    """A recorder for the parsed `--record` flags (or a path), None when not recording.

    Refuses (RecordPathTaken, a ConfigError) a path that exists, before any model is loaded.
    """
    policy: dict[str, str] = {}
    keep = DEFAULT_KEEP
    if isinstance(args_or_path, argparse.Namespace):
        keep = getattr(args_or_path, "record_keep", DEFAULT_KEEP)
        if getattr(args_or_path, "config_file", None):  # `--config FILE.yaml`, as read
            header = {**(header or {}), "config_file": args_or_path.config_file}
        rotate_bytes = args_or_path.record_rotate_bytes
        if hasattr(args_or_path, "on_log_error"):
            policy = {"on_error": args_or_path.on_log_error, "fsync": args_or_path.log_fsync}
        args_or_path = args_or_path.record
    if args_or_path is None:
        return None
    path = Path(os.fspath(args_or_path).replace("{time}", time.strftime("%Y%m%d-%H%M%S")))
    if path.parent == DEFAULT_RECORD_DIR:  # the default directory: made, and kept small
        path.parent.mkdir(exist_ok=True)
        prune(path.parent, keep)
    if path.exists():
        raise RecordPathTaken(f"{path} exists; a log is never overwritten, choose another path")
    return Recorder(path, rotate_bytes or None, header, **policy)
