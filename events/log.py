"""The append-only event log file: a header, then checksummed msgpack records.

Layout of one file (integers little-endian)::

    b"MEMSTEP\\x00"     magic, 8 bytes
    uint16              format version (FORMAT_VERSION)
    frame(header)       msgpack map: format_version, memstep_version, created, + caller's keys
    frame(record) ...   one per record, payload = codec.encode(record)

    frame = uint32 payload length, uint32 zlib.crc32(payload), payload

A crash mid-write leaves at most a torn last frame.  LogReader detects it, and any checksum
mismatch or undecodable payload, keeps every record before it and reports a LogProblem.  Damage
followed by more records (a flipped byte mid-file) is skipped: the reader resynchronises at the
next offset where an intact frame (a plausible length, a matching CRC, a decodable record) starts,
and the LogProblem says which bytes were lost.  Damage with nothing intact after it is a tail.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import struct
import warnings
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Literal, Self

import attrs
import msgpack

from memstep.events import codec, plan, wire  # noqa: F401  (plan, wire: their records, registered)
from memstep.events.input_marks import (
    INPUT_MARKS_SINCE,
    InputChecker,
    InputCounter,
    InputOrderError,
)
from memstep.events.types import is_input
from memstep.events.version import VERSION

MAGIC = b"MEMSTEP\x00"
# Raised when a log may hold a record an older reader cannot decode, or lacks one a newer
# writer always writes: an older memstep refuses the newer log; a newer one reads every older
# format (a record type's SINCE_FORMAT says which formats hold it).  2: RequestPreempted.  3: an
# InputMark before each input (`events/input_marks.py`).  4: a request's sampling params as a
# SamplingParams record (a plain map before; `_typed_params` reads those).  5: the automatic
# speculation threshold's probe gaps in SpecThresholdChanged (`probe_gaps`).
FORMAT_VERSION = 5
TYPED_PARAMS_SINCE = 4
_UNTYPED_PARAMS = ("RequestAdded", "RequestResumed")  # their `params` before format 4
_VERSION = struct.Struct("<H")
_FRAME = struct.Struct("<II")  # payload length, crc32 of payload
_TYPE_KEY = b"\xa1t"  # msgpack fixstr "t": the first key of every record map (codec.to_obj)
_RESERVED_KEYS = ("format_version", "memstep_version", "created")

ProblemKind = Literal["torn", "corrupt", "undecodable", "lost"]  # lost: a RecordsLost gap
PathLike = str | os.PathLike[str]


class LogFormatError(ValueError):
    """The file is not a memstep log this version can read (bad magic, version or header)."""


@attrs.frozen
class LogProblem:
    """A damaged stretch of one log file: bytes [offset, end) held no intact record."""

    path: Path  # the (part) file
    offset: int  # byte offset of the bad frame within its file
    end: int  # where the next intact frame starts; the file's size when none follows
    kind: ProblemKind  # torn: file ends mid-frame; corrupt: bad CRC/length; undecodable: codec
    message: str
    index: int  # how many records of the log were read before it

    @property
    def num_bytes(self) -> int:
        return self.end - self.offset


class _BadFrame(Exception):
    def __init__(self, kind: ProblemKind, message: str, end: int | None = None):
        super().__init__(message)
        self.kind = kind
        self.end = end  # where the next frame starts, when the framing itself is intact


# --- writing -------------------------------------------------------------------------------


class ClosedOnExit:
    """`with X(...) as x:` closes x at the end of the block, however it ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class LogWriter(ClosedOnExit):
    """Appends records to the log at `path`, optionally rotating into `path.1`, `path.2`, ...

    Every part starts with the same header, so each part reads on its own and `read_log` reads
    them in order as one log.  With `rotate_bytes` set, a new part begins before any record that
    would take the current part past `rotate_bytes`; a record is never split, so a part holding
    a single larger record may exceed it.  Parts are created exclusively: an existing file is
    never overwritten (FileExistsError).

    Owns its open file.  `append` buffers; `flush` (called by the engine once per step) hands
    the buffered records to the operating system, all or nothing: a write that fails (a full
    disk, a file-size limit) is cut back to the last whole flush and raises OSError, the records
    still buffered for the next `flush` to retry, so the file never holds half a record.
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
        self._buffer = bytearray()  # frames not yet handed to the OS
        self._inputs = InputCounter() if FORMAT_VERSION >= INPUT_MARKS_SINCE else None
        self._file = self._open_next_part()

    @property
    def parts(self) -> list[Path]:
        """Every file written so far, in order."""
        return [part_path(self._base, i) for i in range(self._num_parts)]

    def append(self, rec: object) -> None:
        """Encode `rec` and append it as one frame (rotating first flushes the current part,
        which may raise OSError: then `rec` was not appended)."""
        payload = codec.encode(rec)
        frame = _frame(payload)
        if self._inputs is not None and is_input(rec):  # its mark first, in the same flush
            frame = _frame(codec.encode(self._inputs.mark(payload))) + frame
        if self._should_rotate(len(frame)):
            self.flush()
            self._file.close()
            self._file = self._open_next_part()
        self._buffer += frame
        self._size += len(frame)
        self._num_records += 1

    def flush(self, fsync: bool = False) -> None:
        """Hand buffered records to the OS, so a reader (or a crash) sees them; with `fsync`,
        to the disk too.  On OSError the file is as after the last flush that worked."""
        fd = self._file.fileno()
        start = os.lseek(fd, 0, os.SEEK_END)
        view = memoryview(self._buffer)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            os.ftruncate(fd, start)
            raise
        finally:
            view.release()
        self._buffer.clear()
        if self._inputs is not None:
            self._inputs.num_flushed = self._inputs.num_inputs
        if fsync:
            os.fsync(fd)

    def discard(self) -> int:
        """Drop the buffered records (they are lost); how many bytes they held."""
        lost = len(self._buffer)
        self._size -= lost
        self._buffer.clear()
        if self._inputs is not None:  # the marks dropped leave no gap
            self._inputs.num_inputs = self._inputs.num_flushed
        if os.fstat(self._file.fileno()).st_size == 0:  # a new part keeps its header
            self._buffer += self._preamble
            self._size += len(self._preamble)
            lost -= len(self._preamble)
        return lost

    def close(self) -> None:
        with contextlib.suppress(OSError):  # what could not be written is lost either way
            self.flush()
        self._file.close()

    def _should_rotate(self, frame_size: int) -> bool:
        if self._rotate_bytes is None or self._num_records == 0:
            return False
        return self._size + frame_size > self._rotate_bytes

    def _open_next_part(self) -> io.FileIO:
        file = open(part_path(self._base, self._num_parts), "xb", buffering=0)  # noqa: SIM115
        self._buffer += self._preamble
        self._num_parts += 1
        self._size = len(self._preamble)
        self._num_records = 0
        return file


def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


# --- reading -------------------------------------------------------------------------------


class LogReader(ClosedOnExit):
    """Reads one log file: `header` on open, then records streamed by iteration.

    Iteration skips each torn, corrupt or undecodable stretch, warns, and lists it in `problems`
    (empty when the file is intact); reading resumes at the next intact frame, if any.  Owns its
    open file; use as a context manager or call `close`.
    """

    def __init__(self, path: PathLike, first_input: int | None = 0):
        """`first_input`: the place of the part's first input among the log's (None: any)."""
        self.path = Path(path)
        self.problems: list[LogProblem] = []
        self.first_input = first_input
        self.inputs = InputChecker(first_input)
        self.format_version = 0
        self._file = open(self.path, "rb")  # noqa: SIM115 - owned
        try:
            self.header = self._read_header()
        except BaseException:
            self._file.close()
            raise
        self._records_start = self._file.tell()

    def __iter__(self) -> Iterator[object]:
        self.problems = []
        self.inputs = InputChecker(self.first_input)
        size = os.fstat(self._file.fileno()).st_size
        offset, num_read = self._records_start, 0
        self._file.seek(offset)
        while offset < size:
            try:
                payload = _read_frame(self._file, size - offset)
                end = offset + _FRAME.size + len(payload)
                rec = _decode(payload, end, self.format_version)
            except _BadFrame as bad:
                end = bad.end if bad.end is not None else self._resync(offset, size)
                self._skip(offset, end, size, bad, num_read)
                self.inputs.lost()
                offset = end
                self._file.seek(offset)
                continue
            if self._checked(rec, payload, offset):
                yield rec
                num_read += 1
            offset += _FRAME.size + len(payload)
        for problem in self.problems:
            _warn(problem, size)

    def close(self) -> None:
        self._file.close()

    def _checked(self, rec: object, payload: bytes, offset: int) -> bool:
        """Whether `rec` is for the caller (an InputMark is the log's own); a LogFormatError
        when the log's inputs are not as recorded."""
        if self.format_version < INPUT_MARKS_SINCE:
            return True
        try:
            return self.inputs.take(rec, payload, offset)
        except InputOrderError as exc:
            raise LogFormatError(f"{self.path}: {exc}; it cannot be replayed as recorded") from exc

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
        self.format_version = version
        try:
            num_left = os.fstat(self._file.fileno()).st_size - self._file.tell()
            header = msgpack.unpackb(_read_frame(self._file, num_left), raw=False)
        except (_BadFrame, ValueError, TypeError, msgpack.UnpackException) as e:
            raise LogFormatError(f"{self.path}: unreadable header: {e}") from e
        if type(header) is not dict:
            raise LogFormatError(f"{self.path}: header is not a map")
        return header

    def _resync(self, offset: int, size: int) -> int:
        """Where the first intact, decodable frame after `offset` starts, or `size` if none does.

        Every record payload is a msgpack map whose first key is "t", so a frame can only start
        9 (fixmap) or 11 (map16) bytes before a b"\\xa1t"; only those offsets are checked.
        """
        if size - offset <= _FRAME.size:
            return size
        with mmap.mmap(self._file.fileno(), size, access=mmap.ACCESS_READ) as view:
            hit = view.find(_TYPE_KEY, offset + _FRAME.size + 2)
            while hit != -1:
                for start in (hit - _FRAME.size - 1, hit - _FRAME.size - 3):
                    if start > offset and _is_frame_at(view, start, size, self.format_version):
                        return start
                hit = view.find(_TYPE_KEY, hit + 1)
        return size

    def _skip(self, offset: int, end: int, size: int, bad: _BadFrame, num_read: int) -> None:
        kind, message = bad.kind, str(bad)
        if kind == "torn" and end < size:  # intact records follow: not a crash mid-write
            kind, message = "corrupt", f"{message}, yet intact records follow"
        last = self.problems[-1] if self.problems else None
        if last is not None and last.end == offset:  # one damaged stretch, not one per frame
            self.problems[-1] = attrs.evolve(last, end=end)
        else:
            self.problems.append(LogProblem(self.path, offset, end, kind, message, num_read))


def _warn(p: LogProblem, size: int) -> None:
    after = (
        f"skipped {p.num_bytes} bytes to the next intact record at byte {p.end}"
        if p.end < size
        else "ignoring it and anything after it"
    )
    warnings.warn(
        f"{p.path}: {p.kind} record at byte {p.offset} ({p.message}); {after}", stacklevel=4
    )


def _read_frame(file: BinaryIO, num_left: int) -> bytes:
    """The next frame's payload, with `num_left` bytes left in the file; raise _BadFrame if bad.

    A length that cannot be right is refused before any payload is read.
    """
    head = file.read(_FRAME.size)
    if len(head) < _FRAME.size:
        raise _BadFrame("torn", f"file ends inside a frame header ({len(head)} bytes)")
    length, crc = _FRAME.unpack(head)
    if length == 0:  # never written (a record is a map); zeros a crash left, whose CRC matches
        raise _BadFrame("corrupt", "frame length 0")
    if length > codec.MAX_RECORD_BYTES:
        raise _BadFrame("corrupt", f"frame length {length} exceeds the record limit")
    if length > num_left - _FRAME.size:
        raise _BadFrame(
            "torn", f"file ends inside a payload ({num_left - _FRAME.size} of {length} bytes)"
        )
    payload = file.read(length)
    if zlib.crc32(payload) != crc:
        raise _BadFrame("corrupt", "payload checksum mismatch")
    return payload


def _decode(payload: bytes, end: int, format_version: int = FORMAT_VERSION) -> object:
    """The record in `payload` of a log of `format_version`; a well-framed payload the codec
    refuses ends at `end`."""
    try:
        if format_version >= TYPED_PARAMS_SINCE:
            return codec.decode(payload)
        return codec.from_obj(_typed_params(codec.unpack(payload)))
    except codec.CodecError as e:
        raise _BadFrame("undecodable", str(e), end) from e


def _typed_params(obj: Any) -> Any:
    """A record map of a log before format 4, as format 4 writes it: a request's sampling
    params were a plain map of the same fields (`SamplingParams.to_dict()`), now a record's."""
    if type(obj) is dict and obj.get("t") in _UNTYPED_PARAMS and type(obj.get("params")) is dict:
        obj["params"] = {"t": "SamplingParams", **obj["params"]}
    return obj


def _is_frame_at(view: mmap.mmap, start: int, size: int, format_version: int) -> bool:
    length, crc = _FRAME.unpack_from(view, start)
    end = start + _FRAME.size + length
    if not 0 < length <= codec.MAX_RECORD_BYTES or end > size:
        return False
    payload = view[start + _FRAME.size : end]
    if zlib.crc32(payload) != crc:
        return False
    try:
        _decode(payload, end, format_version)
    except _BadFrame:
        return False
    return True


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


def read_log(path: PathLike) -> tuple[dict[str, Any], list[object], list[LogProblem]]:
    """Read a whole log, across its rotated parts: (header, records, problems).

    Every intact record of every part, in order; `problems` lists each damaged stretch (empty
    when the log is intact), its `index` counted across parts.  A problem whose `index` equals
    the number of records is a damaged tail; any other is corruption with records after it.
    Raises LogFormatError when a part's header differs from the first part's.
    """
    header: dict[str, Any] | None = None
    records: list[object] = []
    problems: list[LogProblem] = []
    first_input: int | None = 0
    for part in log_parts(path):
        with LogReader(part, first_input) as reader:
            if header is None:
                header = reader.header
            elif reader.header != header:
                raise LogFormatError(f"{part}: header differs from {path}; not the same log")
            num_before = len(records)
            records.extend(reader)
            problems += [attrs.evolve(p, index=p.index + num_before) for p in reader.problems]
            first_input = reader.inputs.next_seq
    assert header is not None  # log_parts always yields `path` first
    return header, records, problems
