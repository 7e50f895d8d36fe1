"""A log cut at a random byte or with a byte flipped: a clear report, the intact prefix replayed,
never a crash.  The tiny random model keeps each replay to a second or two."""

from __future__ import annotations

import json
import random
import struct
import zlib
from pathlib import Path

import pytest
from replay_helpers import memstep

from memstep.events.log import MAGIC
from memstep.events.types import is_input
from memstep.replay.recording import load

_FRAME = struct.Struct("<II")
_RNG = random.Random(20261129)
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
    if cut in {end for _, end in spans}:
        assert "without an engine shutdown" in err and "torn" not in err
    else:
        torn_at = spans[kept][0]
        assert f"log damaged: torn record at byte {torn_at}" in err
        assert "replaying what it holds" in err
    assert report["identical"] is True
    assert report["comparison"]["num_compared"] == num_derived(tiny_log.path, kept)


@pytest.mark.parametrize("where", FLIPS)
def test_flipped_byte_is_reported_and_the_prefix_replayed(tiny_log, tmp_path, where):
    data = bytearray(tiny_log.path.read_bytes())
    start, spans = frames(tiny_log.path)
    at = position(where, start, spans, len(data))
    data[at] ^= 0x5A
    log = tmp_path / "flipped.memlog"
    log.write_bytes(data)
    code, out, err = memstep("replay", str(log), "--json")
    assert code == 0, err
    index = next(i for i, (s, e) in enumerate(spans) if s <= at < e)
    assert f"record at byte {spans[index][0]}" in err
    assert "log damaged: corrupt" in err or "log damaged: torn" in err
    report = json.loads(out)
    assert report["identical"] is True
    assert report["comparison"]["num_compared"] == num_derived(tiny_log.path, index)


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
