"""`memstep replay` of a log that holds a poisoned request (issue 55: a 1,000-deep `$ref` chain,
a 100k-string choice, a 10k-rule grammar, as an older engine admitted them or a hand edited
in): reading the log refuses each such record with its bound (the codec builds its params as
SamplingParams, which checks them), and the replay reports each and exits as for a damaged log;
never a crash of the replaying process."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import msgpack
from replay_helpers import memstep

from memstep.events import codec
from memstep.events.log import MAGIC

_FRAME = struct.Struct("<II")


def _ref_chain(depth: int) -> str:
    defs = {
        f"a{i}": {"type": "array", "items": {"$ref": f"#/$defs/a{i + 1}"}} for i in range(depth)
    }
    defs[f"a{depth}"] = {"type": "string"}
    return json.dumps({"$ref": "#/$defs/a0", "$defs": defs})


def _grammar_chain(rules: int) -> str:
    body = "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(rules))
    return f'root ::= r0\n{body}r{rules} ::= "b"\n'


POISONS = [
    {"guided_json": _ref_chain(1000)},
    {"guided_choice": [f"option {i}" for i in range(100_000)]},
    {"guided_grammar": _grammar_chain(10_000)},
]


def poison(path: Path, out: Path) -> Path:
    """The log at `path` with each of the first RequestAdded records' params holding one of
    POISONS (its CRC, and its InputMark's, made anew): what a hand edit leaves, since no engine
    writes a record its params refuse."""
    data = path.read_bytes()
    offset = len(MAGIC) + 2
    offset += _FRAME.size + _FRAME.unpack_from(data, offset)[0]  # the header
    frames, left = [data[:offset]], list(POISONS)
    while offset < len(data):
        length, _ = _FRAME.unpack_from(data, offset)
        obj = codec.unpack(data[offset + _FRAME.size : offset + _FRAME.size + length])
        offset += _FRAME.size + length
        if obj["t"] == "RequestAdded" and left:
            obj["params"] |= left.pop(0)
            payload = msgpack.packb(obj)
            mark = codec.unpack(frames[-1][_FRAME.size :]) | {"crc": zlib.crc32(payload)}
            frames[-1] = _framed(msgpack.packb(mark))
        frames.append(_framed(msgpack.packb(obj)))
    out.write_bytes(b"".join(frames))
    return out


def _framed(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def test_replay_of_a_poisoned_log_refuses_the_poison_and_exits_with_its_reason(tiny_log, tmp_path):
    poisoned = poison(tiny_log.path, tmp_path / "poisoned.memlog")
    code, out, err = memstep("replay", str(poisoned))
    assert code == 3, (out, err)
    assert "Traceback" not in out + err
    refused = [part for part in out.split("; ") if "undecodable record" in part]
    assert len(refused) == 3, out
    assert "nested deeper" in refused[0] and "bytes of constraint text" in refused[1]
    assert "grammar rules" in refused[2] and "RequestAdded.params" in refused[2]
