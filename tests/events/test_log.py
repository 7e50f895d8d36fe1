"""The event log file: real files written, cut, corrupted and read back."""

from __future__ import annotations

import struct
import subprocess
import sys
import tracemalloc
import warnings
import zlib
from datetime import datetime
from pathlib import Path

import attrs
import msgpack
import pytest

import memstep
from memstep.events import codec
from memstep.events.log import (
    FORMAT_VERSION,
    MAGIC,
    LogFormatError,
    LogReader,
    LogWriter,
    log_parts,
    read_log,
)
from memstep.events.sampling_params import SamplingParams
from memstep.events.types import (
    EngineStarted,
    InputMark,
    MemoryReport,
    RequestAdded,
    StepFinished,
    StepPlanned,
    is_input,
)

HEADER = {"config": {"max_batch": 4, "page_size": 16}, "model_identity": "random:tiny:seed=0"}
MEMORY = MemoryReport(
    live_bytes=1 << 20,
    reserved_bytes=2 << 20,
    num_segments=2,
    num_allocs=0,
    arena_claimed_bytes=0,
    kv_pages_used=1,
)


def step_records(num_steps: int, prompt_len: int = 5) -> list[object]:
    """A plausible engine run: start, one request, then a plan and a result per step."""
    records: list[object] = [
        EngineStarted(memstep_version="0.1.0", config=HEADER["config"], model_identity="m"),
        RequestAdded(
            step=0,
            request_id="r0",
            prompt_token_ids=list(range(prompt_len)),
            params=SamplingParams(max_tokens=num_steps),
            arrival_time=0.0,
        ),
    ]
    for step in range(num_steps):
        records.append(StepPlanned(step=step, kind="decode", batch=[["r0", 1]], num_tokens=1))
        records.append(
            StepFinished(
                step=step,
                kind="decode",
                sampled=[["r0", [step]]],
                num_proposed=0,
                num_accepted=0,
                memory=MEMORY,
            )
        )
    return records


RECORDS = step_records(3)


def write_log(path: Path, records: list[object], rotate_bytes: int | None = None) -> LogWriter:
    with LogWriter(path, HEADER, rotate_bytes=rotate_bytes) as writer:
        for rec in records:
            writer.append(rec)
    return writer


def frame_starts(path: Path, records: list[object]) -> list[int]:
    """Byte offset where each record's frame starts, plus the end of the last one."""
    end = path.stat().st_size - sum(8 + len(codec.encode(rec)) for rec in records)
    starts = [end]
    for rec in records:
        end += 8 + len(codec.encode(rec))
        starts.append(end)
    return starts


def read_quietly(path: Path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        header, records, problems = read_log(path)
    return header, records, problems, caught


# --- writing and reading -------------------------------------------------------------------


def test_round_trip(tmp_path):
    path = tmp_path / "run.log"
    write_log(path, RECORDS)
    header, records, problems = read_log(path)
    assert records == RECORDS
    assert problems == []
    assert header["format_version"] == FORMAT_VERSION
    assert header["memstep_version"] == memstep.__version__
    assert datetime.fromisoformat(header["created"]).tzinfo is not None
    assert {k: header[k] for k in HEADER} == HEADER


def test_file_layout_is_magic_version_header_then_crc_frames(tmp_path):
    path = tmp_path / "run.log"
    write_log(path, RECORDS[:1])
    data = path.read_bytes()
    assert data[:8] == MAGIC == b"MEMSTEP\x00"
    assert struct.unpack_from("<H", data, 8) == (FORMAT_VERSION,)
    header_len, header_crc = struct.unpack_from("<II", data, 10)
    header_payload = data[18 : 18 + header_len]
    assert zlib.crc32(header_payload) == header_crc
    assert msgpack.unpackb(header_payload)["model_identity"] == HEADER["model_identity"]
    offset, payloads = 18 + header_len, []
    while offset < len(data):  # an input's mark, then the input
        rec_len, rec_crc = struct.unpack_from("<II", data, offset)
        payloads.append(data[offset + 8 : offset + 8 + rec_len])
        assert len(payloads[-1]) == rec_len and zlib.crc32(payloads[-1]) == rec_crc
        offset += 8 + rec_len
    assert is_input(RECORDS[0]) and payloads[1] == codec.encode(RECORDS[0])
    assert payloads[0] == codec.encode(InputMark(0, zlib.crc32(payloads[1])))


def test_reader_can_iterate_twice(tmp_path):
    path = tmp_path / "run.log"
    write_log(path, RECORDS)
    with LogReader(path) as reader:
        assert list(reader) == RECORDS
        assert list(reader) == RECORDS
        assert reader.problems == []


def test_flush_makes_records_visible_to_a_reader(tmp_path):
    path = tmp_path / "run.log"
    with LogWriter(path, HEADER) as writer:
        writer.append(RECORDS[0])
        writer.flush()
        assert read_log(path)[1] == RECORDS[:1]


def test_reader_streams_instead_of_loading_the_file(tmp_path):
    path = tmp_path / "big.log"
    prompt = RECORDS[1]
    with LogWriter(path, HEADER) as writer:
        for i in range(1000):
            writer.append(attrs.evolve(prompt, request_id=f"r{i}", prompt_token_ids=[i] * 1000))
    assert path.stat().st_size > 2_500_000
    tracemalloc.start()
    with LogReader(path) as reader:
        num_records = sum(1 for _ in reader)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert num_records == 1000
    assert peak < 1_000_000  # a few records at a time, never the whole file


def test_writer_refuses_reserved_header_keys(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        LogWriter(tmp_path / "run.log", {"format_version": 7})


def test_writer_never_overwrites(tmp_path):
    path = tmp_path / "run.log"
    write_log(path, RECORDS)
    with pytest.raises(FileExistsError):
        LogWriter(path, HEADER)
    assert read_log(path)[1] == RECORDS


# --- damaged files -------------------------------------------------------------------------


def test_truncation_at_every_offset_keeps_the_intact_prefix(tmp_path):
    path = tmp_path / "run.log"
    write_log(path, RECORDS)
    data = path.read_bytes()
    starts = frame_starts(path, RECORDS)
    cut_path = tmp_path / "cut.log"
    for cut in range(starts[-4], len(data) + 1):  # through the last three records
        cut_path.write_bytes(data[:cut])
        header, records, problems, caught = read_quietly(cut_path)
        num_intact = sum(1 for end in starts[1:] if end <= cut)
        assert records == RECORDS[:num_intact], cut
        if cut in starts:
            assert problems == [] and not caught, cut
        else:
            [problem] = problems
            assert problem.kind == "torn" and problem.index == num_intact, cut
            assert (problem.offset, problem.end) == (starts[num_intact], cut), cut
            assert len(caught) == 1 and "torn" in str(caught[0].message), cut


@pytest.mark.parametrize("cut", [0, 5, 8, 9, 10, 17, 20])
def test_truncated_preamble_is_a_format_error(tmp_path, cut):
    path = tmp_path / "run.log"
    write_log(path, RECORDS)
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(LogFormatError):
        read_log(path)


def test_flipped_byte_anywhere_in_a_middle_record_loses_only_that_record(tmp_path):
    path = tmp_path / "run.log"
    write_log(path, RECORDS)
    data = path.read_bytes()
    starts = frame_starts(path, RECORDS)
    bad_index = 3
    for position in range(starts[bad_index], starts[bad_index + 1]):  # length, CRC and payload
        damaged = bytearray(data)
        damaged[position] ^= 0x40
        path.write_bytes(bytes(damaged))
        header, records, problems, caught = read_quietly(path)
        assert records == RECORDS[:bad_index] + RECORDS[bad_index + 1 :], position
        [problem] = problems
        assert problem.kind == "corrupt" and problem.index == bad_index, position
        assert (problem.offset, problem.end) == tuple(starts[bad_index : bad_index + 2]), position
        assert len(caught) == 1 and "skipped" in str(caught[0].message), position


def test_flipped_byte_in_the_last_record_is_a_damaged_tail(tmp_path):
    path = tmp_path / "run.log"
    write_log(path, RECORDS)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    header, records, problems, caught = read_quietly(path)
    assert records == RECORDS[:-1]
    [problem] = problems
    assert problem.kind == "corrupt" and problem.index == len(records)
    assert problem.end == len(data)
    assert "ignoring it and anything after it" in str(caught[0].message)


def test_every_gap_is_skipped_and_reported(tmp_path):
    path = tmp_path / "run.log"
    records = step_records(10)
    write_log(path, records)
    starts = frame_starts(path, records)
    data = bytearray(path.read_bytes())
    for index in (2, 9, 10, 15):  # 9 and 10 make one stretch of two records
        data[starts[index] + 12] ^= 0x01
    path.write_bytes(bytes(data))
    header, read, problems, caught = read_quietly(path)
    assert read == [r for i, r in enumerate(records) if i not in (2, 9, 10, 15)]
    assert [(p.index, p.offset, p.end) for p in problems] == [
        (2, starts[2], starts[3]),
        (8, starts[9], starts[11]),
        (12, starts[15], starts[16]),
    ]
    assert len(caught) == 3


def append_raw_frame(path: Path, payload: bytes, length: int | None = None) -> None:
    with open(path, "ab") as f:
        f.write(struct.pack("<II", len(payload) if length is None else length, zlib.crc32(payload)))
        f.write(payload)


def test_well_framed_garbage_is_undecodable_and_skipped(tmp_path):
    path = tmp_path / "run.log"
    write_log(path, RECORDS)
    end = path.stat().st_size
    garbage = msgpack.packb({"t": "NotARecord"})
    append_raw_frame(path, garbage)
    append_raw_frame(path, garbage)  # the same stretch
    append_raw_frame(path, codec.encode(RECORDS[0]))
    header, records, problems, caught = read_quietly(path)
    assert records == RECORDS + RECORDS[:1]
    [problem] = problems
    assert problem.kind == "undecodable" and "NotARecord" in problem.message
    assert (problem.offset, problem.end) == (end, end + 2 * (8 + len(garbage)))
    assert len(caught) == 1


@pytest.mark.parametrize("length", [0xFFFF_FFFF, codec.MAX_RECORD_BYTES])
def test_absurd_frame_length_is_never_read(tmp_path, length):
    """A length beyond the record limit, or beyond the file, is refused before reading it."""
    path = tmp_path / "run.log"
    records = step_records(200)
    write_log(path, records)
    starts = frame_starts(path, records)
    data = bytearray(path.read_bytes())
    bad = len(records) // 2
    struct.pack_into("<I", data, starts[bad], length)
    path.write_bytes(bytes(data))
    tracemalloc.start()
    header, read, problems, caught = read_quietly(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert read == records[:bad] + records[bad + 1 :]
    [problem] = problems
    assert problem.kind == "corrupt"
    assert (problem.offset, problem.end) == (starts[bad], starts[bad + 1])
    assert str(length) in problem.message
    assert peak < 1_000_000 < codec.MAX_RECORD_BYTES


@pytest.mark.parametrize("where", ["tail", "middle"])
def test_zeros_are_one_damaged_stretch(tmp_path, where):
    """A crash can leave zeros where records were due; a zero frame (length 0, CRC 0) even
    passes its checksum, yet it is one damaged stretch, never a problem per 8 bytes."""
    path = tmp_path / "run.log"
    write_log(path, RECORDS)
    starts = frame_starts(path, RECORDS)
    data = path.read_bytes()
    at = starts[-1] if where == "tail" else starts[4]
    path.write_bytes(data[:at] + bytes(4096) + data[at:])
    header, records, problems, caught = read_quietly(path)
    assert records == RECORDS
    [problem] = problems
    assert (problem.offset, problem.num_bytes, problem.index) == (
        at,
        4096,
        8 if where == "tail" else 4,
    )
    assert problem.kind == "corrupt" and "frame length 0" in problem.message
    assert len(caught) == 1


def test_wrong_magic_is_a_format_error(tmp_path):
    path = tmp_path / "run.log"
    write_log(path, RECORDS)
    path.write_bytes(b"NOTMEMST" + path.read_bytes()[8:])
    with pytest.raises(LogFormatError, match="not a memstep log"):
        LogReader(path)


@pytest.mark.parametrize(
    ("version", "match"),
    [
        (
            FORMAT_VERSION + 1,
            rf"^log format version {FORMAT_VERSION + 1} is newer than this memstep supports "
            rf"\({FORMAT_VERSION}\); upgrade memstep$",
        ),
        (0, "version 0 does not exist"),
    ],
)
def test_unsupported_version_is_a_format_error(tmp_path, version, match):
    path = tmp_path / "run.log"
    write_log(path, RECORDS)
    data = bytearray(path.read_bytes())
    data[8:10] = struct.pack("<H", version)
    path.write_bytes(bytes(data))
    with pytest.raises(LogFormatError, match=match):
        read_log(path)


def test_corrupt_header_is_a_format_error(tmp_path):
    path = tmp_path / "run.log"
    write_log(path, RECORDS)
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01  # inside the header payload
    path.write_bytes(bytes(data))
    with pytest.raises(LogFormatError, match="unreadable header"):
        read_log(path)


# --- rotation ------------------------------------------------------------------------------


def test_rotation_writes_parts_that_read_back_in_order(tmp_path):
    path = tmp_path / "run.log"
    records = step_records(20)
    writer = write_log(path, records, rotate_bytes=1024)
    parts = list(log_parts(path))
    assert len(parts) >= 3
    assert parts == writer.parts == [path] + [Path(f"{path}.{i}") for i in range(1, len(parts))]
    assert all(part.stat().st_size <= 1024 for part in parts)
    per_part = []
    for part in parts:
        with LogReader(part) as reader:
            assert reader.header == read_log(path)[0]
            per_part.extend(reader)
    assert per_part == records
    assert read_log(path)[1:] == (records, [])


def test_a_record_larger_than_rotate_bytes_gets_a_part_of_its_own(tmp_path):
    path = tmp_path / "run.log"
    writer = write_log(path, RECORDS, rotate_bytes=1)
    assert len(writer.parts) == len(RECORDS)
    assert read_log(path)[1] == RECORDS


def test_torn_middle_part_is_a_gap_and_later_parts_are_read(tmp_path):
    path = tmp_path / "run.log"
    records = step_records(20)
    writer = write_log(path, records, rotate_bytes=1024)
    per_part = [list(LogReader(part)) for part in writer.parts]
    middle = writer.parts[1]
    middle.write_bytes(middle.read_bytes()[:-3])
    header, read, problems, caught = read_quietly(path)
    lost = per_part[1][-1]
    assert read == [r for part in per_part for r in part if r is not lost]
    [problem] = problems
    assert problem.kind == "torn" and problem.path == middle
    assert problem.index == len(per_part[0]) + len(per_part[1]) - 1 < len(read)


def test_part_from_another_log_is_refused(tmp_path):
    path = tmp_path / "run.log"
    write_log(path, RECORDS)
    with LogWriter(tmp_path / "other.log", {"model_identity": "other"}) as other:
        other.append(RECORDS[0])
    (tmp_path / "other.log").rename(f"{path}.1")
    with pytest.raises(LogFormatError, match="header differs"):
        read_log(path)


@pytest.mark.parametrize("module", ["memstep.events.log", "memstep.replay.recording"])
def test_a_log_reader_alone_knows_every_record_the_engine_writes(module):
    """`memstep inspect` loads no engine: the reader's own imports must register every record
    class (a GPU run's MemoryPlanned was once read as corruption)."""

    code = (
        f"import {module}\n"
        "from memstep.events.types import REGISTRY\n"
        "print(sorted({'MemoryPlanned', 'ExecutorStop', 'StepPlan'} - set(REGISTRY)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
