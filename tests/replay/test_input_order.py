"""A log's inputs replay only as recorded (log format 3): an input duplicated, moved or taken out
is refused with a clear message (exit 2), never replayed as "identical"; damage still costs only
what it hit; a log of format 2, written before the input marks, replays identically."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
from replay_helpers import memstep, record

from memstep.core.config import EngineConfig
from memstep.events import codec
from memstep.events.log import FORMAT_VERSION, MAGIC, LogFormatError, LogWriter, read_log
from memstep.events.types import InputMark, RequestAdded, is_input
from memstep.replay.recording import load

_FRAME = struct.Struct("<II")
FORMAT_2_LOG = Path(__file__).parent / "data" / "format2.memlog"  # written by memstep c151d4b


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny random model: 5 requests in two waves, one aborted."""
    path = tmp_path_factory.mktemp("order") / "run.memlog"
    cfg = EngineConfig(model="random:tiny", max_num_seqs=4, num_threads=1)
    record(path, cfg, [3, 2], max_tokens=(3, 5), abort_every=4)
    return path


def split(path: Path) -> tuple[bytes, list[bytes]]:
    """The bytes before the first record (magic, version, header), and each record's frame."""
    data = path.read_bytes()
    assert data.startswith(MAGIC)
    offset, frames = len(MAGIC) + 2, []
    while offset < len(data):
        length, _ = _FRAME.unpack_from(data, offset)
        frames.append(data[offset : offset + _FRAME.size + length])
        offset += _FRAME.size + length
    return data[: len(MAGIC) + 2 + len(frames[0])], frames[1:]


def decoded(frame: bytes) -> object:
    return codec.decode(frame[_FRAME.size :])


def added(frames: list[bytes]) -> list[int]:
    """The index of each RequestAdded's frame."""
    return [i for i, f in enumerate(frames) if isinstance(decoded(f), RequestAdded)]


def write(path: Path, head: bytes, frames: list[bytes]) -> Path:
    path.write_bytes(head + b"".join(frames))
    return path


def refused(path: Path, words: str) -> None:
    code, out, err = memstep("replay", str(path))
    assert code == 2 and words in err and "cannot be replayed as recorded" in err, (code, out, err)


def test_a_log_marks_each_input_and_replays_identically(tiny: Path):
    head, frames = split(tiny)
    records = [decoded(f) for f in frames]
    marks = [i for i, r in enumerate(records) if isinstance(r, InputMark)]
    assert [records[i].seq for i in marks] == list(range(len(marks))) and marks
    assert all(is_input(records[i + 1]) for i in marks)
    assert all(records[i].crc == zlib.crc32(frames[i + 1][_FRAME.size :]) for i in marks)
    assert load(tiny).format_version == FORMAT_VERSION >= 3
    assert not any(isinstance(r, InputMark) for r in load(tiny).records)  # the log's own
    assert memstep("replay", str(tiny))[0] == 0


def test_a_duplicated_input_is_refused(tiny: Path, tmp_path: Path):
    head, frames = split(tiny)
    i = added(frames)[1]
    copied = frames[: i + 1] + [frames[i]] + frames[i + 1 :]  # the record alone, copied
    refused(write(tmp_path / "dup.memlog", head, copied), "has no input mark before it")
    pair = frames[i - 1 : i + 1]  # the record with its mark
    twice = frames[: i + 1] + pair + frames[i + 1 :]
    refused(write(tmp_path / "dup2.memlog", head, twice), "comes again")


def test_a_reordered_input_is_refused(tiny: Path, tmp_path: Path):
    head, frames = split(tiny)
    a, b = added(frames)[:2]
    swapped = list(frames)
    swapped[a], swapped[b] = frames[b], frames[a]  # the records, each under the other's mark
    refused(write(tmp_path / "swap.memlog", head, swapped), "reordered or changed")
    pairs = list(frames)
    pairs[a - 1 : a + 1], pairs[b - 1 : b + 1] = frames[b - 1 : b + 1], frames[a - 1 : a + 1]
    refused(write(tmp_path / "swap2.memlog", head, pairs), "out of order")


def test_a_removed_input_is_refused(tiny: Path, tmp_path: Path):
    head, frames = split(tiny)
    i = added(frames)[2]
    refused(write(tmp_path / "cut.memlog", head, frames[: i - 1] + frames[i + 1 :]), "taken out")


def test_damage_over_an_input_is_a_gap_not_a_refusal(tiny: Path, tmp_path: Path):
    """A flipped byte in an input's mark is corruption as before (exit 3), not tampering."""
    head, frames = split(tiny)
    i = added(frames)[1]
    flipped = list(frames)
    flipped[i - 1] = frames[i - 1][:-1] + bytes([frames[i - 1][-1] ^ 0xFF])
    path = write(tmp_path / "flip.memlog", head, flipped)
    with pytest.warns(UserWarning, match="corrupt record"):
        _, records, problems = read_log(path)
    assert len(problems) == 1 and any(isinstance(r, RequestAdded) for r in records)
    assert memstep("replay", str(path))[0] == 3


def test_the_check_fires_on_reading_not_only_in_replay(tiny: Path, tmp_path: Path):
    head, frames = split(tiny)
    i = added(frames)[0]
    with pytest.raises(LogFormatError, match="has no input mark"):
        read_log(write(tmp_path / "x.memlog", head, frames[: i + 1] + frames[i:]))


# what the engine measures and plans of its memory, which later engines account otherwise (the
# prompt scorer's rows planned at start-up, the grammar caches' budgets): a log of an older engine
# replays with every token, transition and ledger entry the same, and differs in these only
MEMORY_ACCOUNTING = {
    "StepFinished.memory.live_bytes",
    "StepFinished.memory.reserved_bytes",
    "StepFinished.memory.num_segments",
    "MemoryPlanned.plan.grammar_cache_bytes",
    "MemoryPlanned.plan.sampler_bytes",
    "MemoryPlanned.plan.predicted_peak_bytes",
}


def test_a_format_2_log_reads_whole_and_replays_the_same_tokens():
    """Written by the engine before input marks (format 2) and before the records' newer fields:
    every record decodes (the newer fields take their defaults), and the replay differs in
    nothing but the memory accounting that engines since then do otherwise."""
    assert load(FORMAT_2_LOG).format_version == 2
    assert len(load(FORMAT_2_LOG).inputs) == 6
    code, out, err = memstep("replay", str(FORMAT_2_LOG), "--json")
    report = json.loads(out)
    assert not report["is_corrupt"] and report["problem"] is None, (out, err)
    c = report["comparison"]
    assert isinstance(c, dict) and isinstance(c["first"], dict), "a JSON object, not a literal"
    assert set(c["fields"]) <= MEMORY_ACCOUNTING, c["fields"]
    assert (c["num_missing"], c["num_extra"]) == (0, 0) and report["num_records"] > 28


def test_an_input_duplicated_by_a_rewriting_tool_is_not_identical(tiny: Path, tmp_path: Path):
    """A tool that rewrites a log through LogWriter marks each input anew; a RequestAdded it
    duplicates while its request is in flight is refused by the replayed engine, which the
    recorded engine never did: exit 1, not "identical"."""
    header, records, _ = read_log(tiny)
    i = next(k for k, r in enumerate(records) if isinstance(r, RequestAdded))
    path = tmp_path / "rewritten.memlog"
    own = ("format_version", "memstep_version", "created")
    with LogWriter(path, {k: v for k, v in header.items() if k not in own}) as writer:
        for rec in records[: i + 1] + [records[i]] + records[i + 1 :]:
            writer.append(rec)
    code, out, err = memstep("replay", str(path))
    assert code == 1 and "NOT AS RECORDED" in out and "already in use" in out, (out, err)
