"""Field-by-field comparison of recorded and replayed derived records.

Records are compared as the plain maps the codec writes, so "identical" means identical on disk.
The first divergence is found walking both streams in order.  The counts match records by identity
instead (type, step, and the request for RequestFinished, else the order within the step), so one
early difference does not make every later record count as different.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import attrs
import msgpack

from memstep.events import codec
from memstep.events.types import REGISTRY, is_host_measured, unreplayable_fields

Path = tuple[str | int, ...]


@attrs.frozen
class Divergence:
    """The first place where the replay differs from the recording."""

    index: int  # position among the derived records
    step: int | None
    event: str  # record type, e.g. "StepFinished"
    field: str  # e.g. "sampled[3][1][0]", "memory.live_bytes"; "" for a whole record
    recorded: Any  # the recorded value (None: no such record)
    replayed: Any
    request_id: str | None = None  # the request the differing value belongs to, if any

    def describe(self) -> str:
        where = f"step {self.step}, {self.event}"
        if not self.field:  # a whole record: its type name on each side, None where absent
            rec, rep = self.recorded or "no record", self.replayed or "no record"
            return f"{where}: recorded {rec}, replayed {rep}"
        where += f", field {self.field}"
        if self.request_id is not None:
            where += f" (request {self.request_id})"
        return f"{where}: recorded {_short(self.recorded)}, replayed {_short(self.replayed)}"


@attrs.frozen
class Comparison:
    num_compared: int  # derived records matched between the two streams
    num_differing: int  # matched records whose fields differ
    num_missing: int  # recorded records the replay never emitted
    num_extra: int  # replayed records the recording does not have
    fields: dict[str, int]  # "StepFinished.sampled" -> how many matched records differ there
    first: Divergence | None

    @property
    def is_identical(self) -> bool:
        return self.first is None

    @property
    def num_bad(self) -> int:
        return self.num_differing + self.num_missing + self.num_extra


def compare(recorded: list[object], replayed: list[object]) -> Comparison:
    """Compare two streams of derived records, less those made of host memory figures."""
    rec_objs = [_comparable(r) for r in recorded if not is_host_measured(r)]
    rep_objs = [_comparable(r) for r in replayed if not is_host_measured(r)]
    first = _first_divergence(rec_objs, rep_objs)
    rec_keyed, rep_keyed = _keyed(rec_objs), _keyed(rep_objs)
    fields: Counter[str] = Counter()
    differing = 0
    for key in rec_keyed.keys() & rep_keyed.keys():
        paths = {_pattern(p) for p, _, _ in differences(rec_keyed[key], rep_keyed[key])}
        if paths:
            differing += 1
            fields.update(f"{key[0]}.{p}" for p in paths)
    return Comparison(
        num_compared=len(rec_keyed.keys() & rep_keyed.keys()),
        num_differing=differing,
        num_missing=len(rec_keyed.keys() - rep_keyed.keys()),
        num_extra=len(rep_keyed.keys() - rec_keyed.keys()),
        fields=dict(fields.most_common()),
        first=first,
    )


def differences(a: Any, b: Any, path: Path = ()) -> Iterator[tuple[Path, Any, Any]]:
    """(path, a's value, b's value) of every leaf where plain values `a` and `b` differ.

    `type(a) is type(b)` is part of equality, so 1 and 1.0 (or True and 1) differ.
    """
    if type(a) is dict and type(b) is dict:
        for key in [*a, *(k for k in b if k not in a)]:
            if key not in a or key not in b:
                yield (*path, key), a.get(key), b.get(key)
            else:
                yield from differences(a[key], b[key], (*path, key))
    elif type(a) is list and type(b) is list:
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            yield from differences(x, y, (*path, i))
        if len(a) != len(b):
            yield (*path, "len"), len(a), len(b)
    elif type(a) is not type(b) or a != b:
        yield path, a, b


def replayable_bytes(records: list[object]) -> list[bytes]:
    """Each record's msgpack bytes less what no replay repeats (wall-clock durations, host
    memory figures, host-growth reports): what "byte for byte" means for a replay."""
    return [msgpack.packb(_comparable(r)) for r in records if not is_host_measured(r)]


# --- helpers -------------------------------------------------------------------------------


def _comparable(rec: object) -> dict:
    """The record as the codec writes it, less the fields no replay repeats (wall-clock, host
    memory), in it and in the records it holds."""
    return _without_unreplayable(codec.to_obj(rec))


def _without_unreplayable(obj: dict) -> dict:
    for name in unreplayable_fields(REGISTRY[obj["t"]]):
        obj.pop(name, None)
    for value in obj.values():
        if type(value) is dict and "t" in value:
            _without_unreplayable(value)
    return obj


def _first_divergence(recorded: list[dict], replayed: list[dict]) -> Divergence | None:
    for i, (a, b) in enumerate(zip(recorded, replayed, strict=False)):
        if a["t"] != b["t"]:
            return Divergence(i, a.get("step"), a["t"], "", a["t"], b["t"])
        diff = next(differences(a, b), None)
        if diff is not None:
            path, x, y = diff
            return Divergence(i, a.get("step"), a["t"], _format(path), x, y, _request_of(a, path))
    n = min(len(recorded), len(replayed))
    if len(recorded) > n:
        rec = recorded[n]
        return Divergence(n, rec.get("step"), rec["t"], "", rec["t"], None)
    if len(replayed) > n:
        rep = replayed[n]
        return Divergence(n, rep.get("step"), rep["t"], "", None, rep["t"])
    return None


def _keyed(objs: list[dict]) -> dict[tuple, dict]:
    """Each record under (type, step, discriminator): the request id, or its order in the step."""
    seen: Counter[tuple] = Counter()
    keyed: dict[tuple, dict] = {}
    for obj in objs:
        base = (obj["t"], obj.get("step"))
        if obj["t"] == "RequestFinished":
            key = (*base, obj["request_id"])
        else:
            key = (*base, seen[base])
            seen[base] += 1
        keyed[key] = obj
    return keyed


def _format(path: Path) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "len":
            out += ".len"
        else:
            out += f".{part}" if out else part
    return out


def _pattern(path: Path) -> str:
    """The field of a path with list indices wildcarded: `sampled[*][1][*]` -> `sampled`."""
    return re.sub(r"\[\d+\]|\.len$", "", _format(path)) or "(record)"


def _request_of(obj: dict, path: Path) -> str | None:
    """The request a list element belongs to, for `[[request_id, ...], ...]` style fields."""
    node: Any = obj
    for part in path:
        if type(node) is list and isinstance(part, int) and part < len(node):
            node = node[part]
            if type(node) is list and node and type(node[0]) is str:
                return node[0]
        elif type(node) is dict and part in node:
            node = node[part]
        else:
            break
    return obj.get("request_id")


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
