"""The append-only event log file: a header, then checksummed msgpack records.

Layout of one file (integers little-endian)::

    b"MEMSTEP\\x00"     magic, 8 bytes
    uint16              format version (FORMAT_VERSION)
    frame(header)       msgpack map: format_version, memstep_version, created, + caller's keys
    frame(record) ...   one per record, payload = codec.encode(record)

    frame = uint32 payload length, uint32 zlib.crc32(payload), payload

A crash mid-write leaves at most a torn last frame.  LogReader detects it, and any checksum
mismatch or undecodable payload, keeps every record before it and reports a LogProblem.
"""

from __future__ import annotations

import os
import struct
import warnings
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Literal

import attrs
import msgpack

from memstep.events import codec
from memstep.events.version import VERSION

MAGIC = b"MEMSTEP\x00"
FORMAT_VERSION = 1
_VERSION = struct.Struct("<H")
_FRAME = struct.Struct("<II")  # payload length, crc32 of payload
_RESERVED_KEYS = ("format_version", "memstep_version", "created")

ProblemKind = Literal["torn", "corrupt", "undecodable"]
PathLike = str | os.PathLike[str]


class LogFormatError(ValueError):
    """The file is not a memstep log this version can read (bad magic, version or header)."""


@attrs.frozen
class LogProblem:
    """Why reading stopped early; every record before `offset` was read intact."""

    offset: int  # byte offset of the bad frame within its file
    kind: ProblemKind  # torn: file ends mid-frame; corrupt: bad CRC/length; undecodable: codec
    message: str


class _BadFrame(Exception):
    def __init__(self, kind: ProblemKind, message: str):
        super().__init__(message)
        self.kind = kind


# --- writing -------------------------------------------------------------------------------


class LogWriter:
    """Appends records to the log at `path`, optionally rotating into `path.1`, `path.2`, ...

    Every part starts with the same header, so each part reads on its own and `read_log` reads
    them in order as one log.  With `rotate_bytes` set, a new part begins before any record that
    would take the current part past `rotate_bytes`; a record is never split, so a part holding
    a single larger record may exceed it.  Parts are created exclusively: an existing file is
    never overwritten (FileExistsError).

    Owns its open file.  `append` buffers; `flush` (called by the engine once per step) hands
    the buffered records to the operating system.
    """

    def __init__(
        self,
        path: PathLike,
        header: dict[str, Any],
        rotate_bytes: int | None = None,
    ):
        clashes = [key for key in _RESERVED_KEYS if key in header]
        if clashes:
            raise ValueError(f"log header keys {clashes} are reserved for the log itself")
        full_header = {
            "format_version": FORMAT_VERSION,
            "memstep_version": VERSION,
            "created": datetime.now(UTC).isoformat(),
            **header,
        }
        header_bytes = msgpack.packb(full_header, use_bin_type=True)
        self._preamble = MAGIC + _VERSION.pack(FORMAT_VERSION) + _frame(header_bytes)
        self._base = Path(path)
        self._rotate_bytes = rotate_bytes
        self._num_parts = 0
        self._size = 0  # bytes in the current part
        self._num_records = 0  # records in the current part
        self._file = self._open_next_part()

    @property
    def parts(self) -> list[Path]:
        """Every file written so far, in order."""
        return [part_path(self._base, i) for i in range(self._num_parts)]

    def append(self, rec: object) -> None:
        """Encode `rec` and append it as one frame."""
        frame = _frame(codec.encode(rec))
        if self._should_rotate(len(frame)):
            self._file.close()
            self._file = self._open_next_part()
        self._file.write(frame)
        self._size += len(frame)
        self._num_records += 1

    def flush(self) -> None:
        """Hand buffered records to the OS, so a reader (or a crash) sees them (no fsync)."""
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _should_rotate(self, frame_size: int) -> bool:
        if self._rotate_bytes is None or self._num_records == 0:
            return False
        return self._size + frame_size > self._rotate_bytes

    def _open_next_part(self) -> BinaryIO:
        file = open(part_path(self._base, self._num_parts), "xb")  # noqa: SIM115 - owned
        file.write(self._preamble)
        self._num_parts += 1
        self._size = len(self._preamble)
        self._num_records = 0
        return file


def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


# --- reading -------------------------------------------------------------------------------


class LogReader:
    """Reads one log file: `header` on open, then records streamed by iteration.

    Iteration stops at the first torn, corrupt or undecodable frame, warns, and leaves the
    reason in `problem` (None when the file ended cleanly).  Owns its open file; use as a
    context manager or call `close`.
    """

    def __init__(self, path: PathLike):
        self.path = Path(path)
        self.problem: LogProblem | None = None
        self._file = open(self.path, "rb")  # noqa: SIM115 - owned
        try:
            self.header = self._read_header()
        except BaseException:
            self._file.close()
            raise
        self._records_start = self._file.tell()

    def __iter__(self) -> Iterator[object]:
        self.problem = None
        self._file.seek(self._records_start)
        offset = self._records_start
        while True:
            try:
                payload = _read_frame(self._file)
                if payload is None:
                    return
                rec = _decode(payload)
            except _BadFrame as bad:
                self._stop(offset, bad.kind, str(bad))
                return
            yield rec
            offset += _FRAME.size + len(payload)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> LogReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _read_header(self) -> dict[str, Any]:
        magic = self._file.read(len(MAGIC))
        if magic != MAGIC:
            raise LogFormatError(f"{self.path}: not a memstep log (magic is {magic!r})")
        raw_version = self._file.read(_VERSION.size)
        if len(raw_version) < _VERSION.size:
            raise LogFormatError(f"{self.path}: file ends inside the format version")
        (version,) = _VERSION.unpack(raw_version)
        if version > FORMAT_VERSION:
            raise LogFormatError(
                f"log format version {version} is newer than this memstep supports "
                f"({FORMAT_VERSION}); upgrade memstep"
            )
        if version < 1:
            raise LogFormatError(f"{self.path}: log format version {version} does not exist")
        try:
            payload = _read_frame(self._file)
            header = None if payload is None else msgpack.unpackb(payload, raw=False)
        except (_BadFrame, ValueError, TypeError, msgpack.UnpackException) as e:
            raise LogFormatError(f"{self.path}: unreadable header: {e}") from e
        if type(header) is not dict:
            raise LogFormatError(f"{self.path}: header is not a map")
        return header

    def _stop(self, offset: int, kind: ProblemKind, message: str) -> None:
        self.problem = LogProblem(offset, kind, f"{self.path}: {message}")
        warnings.warn(
            f"{self.path}: {kind} record at byte {offset} ({message}); "
            "ignoring it and anything after it",
            stacklevel=3,
        )


def _read_frame(file: BinaryIO) -> bytes | None:
    """The next frame's payload, None at a clean end of file; raise _BadFrame otherwise."""
    head = file.read(_FRAME.size)
    if not head:
        return None
    if len(head) < _FRAME.size:
        raise _BadFrame("torn", f"file ends inside a frame header ({len(head)} bytes)")
    length, crc = _FRAME.unpack(head)
    if length > codec.MAX_RECORD_BYTES:
        raise _BadFrame("corrupt", f"frame length {length} exceeds the record limit")
    payload = file.read(length)
    if len(payload) < length:
        raise _BadFrame("torn", f"file ends inside a payload ({len(payload)} of {length} bytes)")
    if zlib.crc32(payload) != crc:
        raise _BadFrame("corrupt", "payload checksum mismatch")
    return payload


def _decode(payload: bytes) -> object:
    try:
        return codec.decode(payload)
    except codec.CodecError as e:
        raise _BadFrame("undecodable", str(e)) from e


# --- whole logs ----------------------------------------------------------------------------


def part_path(path: PathLike, index: int) -> Path:
    """The file of part `index`: `path` itself for 0, then `path.1`, `path.2`, ..."""
    return Path(path) if index == 0 else Path(f"{os.fspath(path)}.{index}")


def log_parts(path: PathLike) -> Iterator[Path]:
    """The files of a possibly rotated log, in order: `path`, then each `path.N` that exists."""
    yield Path(path)
    index = 1
    while part_path(path, index).exists():
        yield part_path(path, index)
        index += 1


def read_log(path: PathLike) -> tuple[dict[str, Any], list[object], LogProblem | None]:
    """Read a whole log, across its rotated parts: (header, records, problem).

    Stops at the first problem in any part; `problem` is None when every part ended cleanly.
    Raises LogFormatError when a part's header differs from the first part's.
    """
    header: dict[str, Any] | None = None
    records: list[object] = []
    for part in log_parts(path):
        with LogReader(part) as reader:
            if header is None:
                header = reader.header
            elif reader.header != header:
                raise LogFormatError(f"{part}: header differs from {path}; not the same log")
            records.extend(reader)
            if reader.problem is not None:
                return header, records, reader.problem
    assert header is not None  # log_parts always yields `path` first
    return header, records, None
