"""A log cut at a random byte or with a byte flipped: a clear report, never a crash.  A torn tail
replays its intact prefix and exits 0; damage with records after it loses only the damaged record,
replays what comes before it and exits 3.  The tiny random model keeps each replay to a second or
two."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import attrs
import pytest
from replay_helpers import memstep

from memstep.events import codec
from memstep.events.log import MAGIC, LogWriter, read_log
from memstep.events.types import InputMark, StepFinished, is_input
from memstep.replay.recording import load

_FRAME = struct.Struct("<II")
_RNG = random.Random(20261129)
RESERVED = ("format_version", "memstep_version", "created")
CUTS = ["first-record", "boundary", "last-byte", *(_RNG.random() for _ in range(4))]
FLIPS = ["first-record", "frame-length", *(_RNG.random() for _ in range(4))]


def frames(path: Path) -> tuple[int, list[tuple[int, int]]]:
    """Where the records begin, and (start, end) of each record frame, parsed independently."""
    data = path.read_bytes()
    assert data.startswith(MAGIC)
    offset = len(MAGIC) + 2
    spans = []
    while offset < len(data):
        length, crc = _FRAME.unpack_from(data, offset)
        end = offset + _FRAME.size + length
        assert zlib.crc32(data[offset + _FRAME.size : end]) == crc
        spans.append((offset, end))
        offset = end
    return spans[0][1], spans[1:]  # the first frame is the header


def position(where: str | float, start: int, spans: list[tuple[int, int]], size: int) -> int:
    if where == "first-record":
        return spans[0][0] + 5
    if where == "frame-length":
        return spans[len(spans) // 3][0] + 1
    if where == "boundary":
        return spans[len(spans) // 2][1]
    if where == "last-byte":
        return size - 1
    assert isinstance(where, float)
    return start + int(where * (size - start))


def marks(path: Path) -> set[int]:
    """The indices (in `frames`) of the frames that hold an input's mark, not a record: the
    reader takes them out, so a damaged mark loses no record."""
    data = path.read_bytes()
    _, spans = frames(path)
    payloads = [data[start + _FRAME.size : end] for start, end in spans]
    return {i for i, payload in enumerate(payloads) if isinstance(codec.decode(payload), InputMark)}


def records_before(path: Path, index: int) -> int:
    """How many records come before frame `index`."""
    return index - sum(i < index for i in marks(path))


def num_derived(path: Path, num_records: int) -> int:
    return sum(not is_input(r) for r in load(path).records[:num_records])


@pytest.mark.parametrize("where", CUTS)
def test_truncated_log_replays_its_intact_prefix(tiny_log, tmp_path, where):
    data = tiny_log.path.read_bytes()
    start, spans = frames(tiny_log.path)
    cut = position(where, start, spans, len(data))
    log = tmp_path / "cut.memlog"
    log.write_bytes(data[:cut])
    code, out, err = memstep("replay", str(log), "--json")
    assert code == 0, err
    report = json.loads(out)
    kept = sum(end <= cut for _, end in spans)
    kept_records = records_before(tiny_log.path, kept)
    if cut in {end for _, end in spans}:
        assert "without an engine shutdown" in err and "torn" not in err
    else:
        torn_at = spans[kept][0]
        assert f"log damaged: torn record at byte {torn_at}" in err
        assert "replaying what it holds" in err
    assert report["identical"] is True
    assert report["comparison"]["num_compared"] == num_derived(tiny_log.path, kept_records)


def damaged_copy(tiny_log, tmp_path: Path, damage) -> tuple[Path, list[tuple[int, int]]]:
    """A copy of the recorded log with `damage(data, spans)` applied; the spans of the original."""
    data = bytearray(tiny_log.path.read_bytes())
    _, spans = frames(tiny_log.path)
    damage(data, spans)
    log = tmp_path / "damaged.memlog"
    log.write_bytes(data)
    return log, spans


def assert_one_record_lost(tiny_log, log: Path, spans: list[tuple[int, int]], index: int) -> dict:
    """Replay `log`, whose frame `index` (of `spans`) is damaged, as a corrupt log: exit 3,
    every other record recovered, the records before it checked, the rest reported unchecked.
    A damaged input mark loses no record (its input is read on, as after any gap)."""
    code, out, err = memstep("replay", str(log), "--json")
    assert code == 3, err
    written = load(tiny_log.path).records
    recovered = load(log).records
    is_mark = index in marks(tiny_log.path)
    before = records_before(tiny_log.path, index)
    after = len(written) - before - (not is_mark)
    assert len(written) == len(spans) - len(marks(tiny_log.path))
    assert recovered == written[:before] + written[len(written) - after :]
    start, end = spans[index]
    assert f"log corrupt: corrupt record at byte {start} of {log}" in err
    assert f"bytes {start}-{end} ({end - start} bytes) lost" in err
    assert f"{after} records recovered after it" in err
    assert "replaying the records before the first gap" in err
    report = json.loads(out)
    assert report["exit_code"] == 3 and report["is_corrupt"] is True
    assert report["identical"] is True
    assert report["comparison"]["num_compared"] == num_derived(tiny_log.path, before)
    assert report["num_unchecked"] == after
    assert report["num_unchecked_inputs"] == sum(map(is_input, written[len(written) - after :]))
    return report


def test_flipped_byte_in_a_middle_record_loses_only_that_record(tiny_log, tmp_path):
    middle = len(frames(tiny_log.path)[1]) // 2

    def flip(data: bytearray, spans: list[tuple[int, int]]) -> None:
        data[spans[middle][0] + _FRAME.size + 3] ^= 0x01

    log, spans = damaged_copy(tiny_log, tmp_path, flip)
    assert_one_record_lost(tiny_log, log, spans, middle)


@pytest.mark.parametrize("length", [0xFFFF_FFF0, 60 << 20])
def test_huge_length_prefix_in_a_middle_record_loses_only_that_record(tiny_log, tmp_path, length):
    """A length over the record limit, or under it but past the end of the file: never read."""
    middle = len(frames(tiny_log.path)[1]) // 2

    def claim(data: bytearray, spans: list[tuple[int, int]]) -> None:
        struct.pack_into("<I", data, spans[middle][0], length)

    log, spans = damaged_copy(tiny_log, tmp_path, claim)
    assert_one_record_lost(tiny_log, log, spans, middle)


@pytest.mark.parametrize("where", FLIPS)
def test_flipped_byte_anywhere_loses_only_its_record(tiny_log, tmp_path, where):
    at = -1

    def flip(data: bytearray, spans: list[tuple[int, int]]) -> None:
        nonlocal at
        at = position(where, spans[0][0], spans, len(data))
        data[at] ^= 0x5A

    log, spans = damaged_copy(tiny_log, tmp_path, flip)
    index = next(i for i, (s, e) in enumerate(spans) if s <= at < e)
    if index < len(spans) - 1:
        assert_one_record_lost(tiny_log, log, spans, index)
        return
    code, out, err = memstep("replay", str(log), "--json")  # the last record: a damaged tail
    assert code == 0 and f"record at byte {spans[index][0]}" in err and "log damaged" in err
    before = records_before(tiny_log.path, index)
    assert json.loads(out)["comparison"]["num_compared"] == num_derived(tiny_log.path, before)


def test_corrupt_log_is_reported_by_replay_text_and_inspect(tiny_log, tmp_path):
    def flip(data: bytearray, spans: list[tuple[int, int]]) -> None:
        data[spans[len(spans) // 3][1] - 2] ^= 0x10

    log, spans = damaged_copy(tiny_log, tmp_path, flip)
    code, out, err = memstep("replay", str(log))
    assert code == 3
    assert "! corrupt log: only the records before the first gap were replayed" in out
    assert "before the gap; the rest of the log is unchecked" in out
    code, out, err = memstep("inspect", str(log))
    assert code == 0 and "log corrupt: corrupt record at byte" in err
    assert "! log corrupt: corrupt record at byte" in out
    code, out, err = memstep("inspect", str(log), "--json")
    summary = json.loads(out)["log"]
    start, end = spans[len(spans) // 3]
    assert summary["corrupt"] is True and summary["num_bytes_lost"] == end - start
    lost = len(spans) // 3 not in marks(tiny_log.path)
    assert summary["num_records"] == len(spans) - len(marks(tiny_log.path)) - lost


def test_replay_help_documents_the_exit_codes():
    res = subprocess.run(
        [sys.executable, "-m", "memstep.cli.main", "replay", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0
    text = " ".join(res.stdout.split())
    assert "1 diverged" in text and "3 corrupt log: records lost mid-file" in text


@pytest.mark.parametrize(
    ("offset", "message"),
    [(0, "not a memstep log"), (8, "newer than this memstep"), (20, "unreadable header")],
)
def test_damaged_header_is_a_clear_error(tiny_log, tmp_path, offset, message):
    data = bytearray(tiny_log.path.read_bytes())
    data[offset] ^= 0x5A
    log = tmp_path / "bad-header.memlog"
    log.write_bytes(data)
    for command in ("replay", "inspect", "plot"):
        code, out, err = memstep(command, str(log))
        assert code == 2 and out == ""
        assert err.startswith("memstep: error:") and message in err


def test_a_divergence_before_the_gap_is_still_exit_1(tiny_log, tmp_path):
    """Corruption does not hide a divergence in the records that could be checked."""
    header, records, _ = read_log(tiny_log.path)
    edited = next(
        i for i, r in enumerate(records) if isinstance(r, StepFinished) and r.memory.live_bytes
    )
    memory = attrs.evolve(records[edited].memory, live_bytes=records[edited].memory.live_bytes + 1)
    records[edited] = attrs.evolve(records[edited], memory=memory)
    log = tmp_path / "edited.memlog"
    with LogWriter(log, {k: v for k, v in header.items() if k not in RESERVED}) as writer:
        for rec in records:
            writer.append(rec)
    _, spans = frames(log)
    data = bytearray(log.read_bytes())
    data[spans[len(spans) // 2][0] + 12] ^= 0x01
    log.write_bytes(data)
    code, out, err = memstep("replay", str(log), "--json")
    report = json.loads(out)
    assert code == 1 and report["exit_code"] == 1
    assert report["is_corrupt"] is True and report["identical"] is False
    assert report["comparison"]["first"]["step"] == records[edited].step
