"""Replay must notice a log that was changed: one token, one ledger line, one memory figure, one
missing record.  Each is reported at exactly its step and field; nothing else differs.  Also the
what-if runs (`--set`), which report differences instead of failing.  Tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from replay_helpers import memstep

from memstep.events.log import LogWriter, read_log
from memstep.events.types import (
    LedgerEntry,
    RequestFinished,
    StateEntered,
    StateExited,
    StepFinished,
)

RESERVED = ("format_version", "memstep_version", "created")


def rewrite(src: Path, dst: Path, index: int, new: object | None) -> None:
    """Copy the log at `src` to `dst` with record `index` replaced by `new` (None: dropped)."""
    header, records, problems = read_log(src)
    assert problems == []
    with LogWriter(dst, {k: v for k, v in header.items() if k not in RESERVED}) as writer:
        for i, rec in enumerate(records):
            if i != index:
                writer.append(rec)
            elif new is not None:
                writer.append(new)


def edit_token(records: list) -> tuple[int, object, str, int, int]:
    """Change the first token the second request of a mid-run step sampled."""
    i = next(
        i
        for i, r in enumerate(records)
        if isinstance(r, StepFinished) and r.step > 10 and len(r.sampled) >= 2
    )
    rec = records[i]
    old = rec.sampled[1][1][0]
    sampled = [list(pair) for pair in rec.sampled]
    sampled[1] = [sampled[1][0], [(old + 1) % 512, *sampled[1][1][1:]]]
    return i, attrs.evolve(rec, sampled=sampled), "sampled[1][1][0]", old, (old + 1) % 512


def edit_ledger(records: list) -> tuple[int, object, str, int, int]:
    """Claim 256 bytes more in the ledger of a mid-run entry into `spec`."""
    entered = [i for i, r in enumerate(records) if isinstance(r, StateEntered) and r.kind == "spec"]
    i = entered[len(entered) // 2]
    rec = records[i]
    old = rec.ledger[0].nbytes
    ledger = [attrs.evolve(rec.ledger[0], nbytes=old + 256), *rec.ledger[1:]]
    assert isinstance(ledger[0], LedgerEntry)
    return i, attrs.evolve(rec, ledger=ledger), "ledger[0].nbytes", old, old + 256


def edit_warmup_release(records: list) -> tuple[int, object, str, int, int]:
    """Say warm-up's exit hook gave back 256 bytes fewer than its entry claimed."""
    i = next(i for i, r in enumerate(records) if isinstance(r, StateExited) and r.kind == "warmup")
    rec = records[i]
    old = rec.bytes_released
    return i, attrs.evolve(rec, bytes_released=old - 256), "bytes_released", old, old - 256


def edit_live_bytes(records: list) -> tuple[int, object, str, int, int]:
    """Report 4 KiB more live bytes after the last step."""
    i = max(i for i, r in enumerate(records) if isinstance(r, StepFinished))
    rec = records[i]
    old = rec.memory.live_bytes
    memory = attrs.evolve(rec.memory, live_bytes=old + 4096)
    return i, attrs.evolve(rec, memory=memory), "memory.live_bytes", old, old + 4096


@pytest.mark.parametrize(
    ("edit", "counted_as"),
    [
        (edit_token, "StepFinished.sampled"),
        (edit_ledger, "StateEntered.ledger.nbytes"),
        (edit_warmup_release, "StateExited.bytes_released"),
        (edit_live_bytes, "StepFinished.memory.live_bytes"),
    ],
)
def test_one_edited_field_is_reported_at_its_step_and_field(tiny_log, tmp_path, edit, counted_as):
    _, records, _ = read_log(tiny_log.path)
    index, new, field, original, edited = edit(records)
    log = tmp_path / "edited.memlog"
    rewrite(tiny_log.path, log, index, new)
    code, out, _ = memstep("replay", str(log), "--json")
    assert code == 1
    c = json.loads(out)["comparison"]
    event = type(new).__name__
    first = c["first"]
    assert (first["step"], first["event"], first["field"]) == (new.step, event, field)
    assert (first["recorded"], first["replayed"]) == (edited, original)
    assert (c["num_differing"], c["num_missing"], c["num_extra"]) == (1, 0, 0)
    assert c["fields"] == {counted_as: 1}
    code, text, _ = memstep("replay", str(log))
    assert code == 1
    assert f"DIVERGED first at step {new.step}, {event}, field {field}" in text
    assert f"recorded {edited}, replayed {original}" in text


def test_inspect_names_the_kind_whose_ledger_does_not_balance(tiny_log, tmp_path):
    code, text, _ = memstep("inspect", str(tiny_log.path))
    assert code == 0 and "ledger: every kind released to the byte what it claimed" in text
    _, records, _ = read_log(tiny_log.path)
    index, new, *_ = edit_warmup_release(records)
    log = tmp_path / "edited.memlog"
    rewrite(tiny_log.path, log, index, new)
    code, text, _ = memstep("inspect", str(log))
    assert code == 0 and "ledger: NOT BALANCED for warmup" in text
    ledger = text[text.index("ledger: NOT BALANCED") :].splitlines()
    row = next(line.split() for line in ledger if line.startswith("  warmup "))
    claimed, released = (int(v.replace(",", "")) for v in row[3:5])
    assert claimed - released == 256 and row[5] == "+256"


def test_dropped_record_is_reported_missing(tiny_log, tmp_path):
    _, records, _ = read_log(tiny_log.path)
    index = next(
        i
        for i, (r, after) in enumerate(zip(records, records[1:], strict=False))
        if isinstance(r, RequestFinished) and not isinstance(after, RequestFinished)
    )
    log = tmp_path / "dropped.memlog"
    rewrite(tiny_log.path, log, index, None)
    code, out, _ = memstep("replay", str(log), "--json")
    assert code == 1
    c = json.loads(out)["comparison"]
    assert (c["num_differing"], c["num_missing"], c["num_extra"]) == (0, 0, 1)
    assert c["first"]["step"] == records[index].step
    assert c["first"]["replayed"] == "RequestFinished"


def test_what_if_reports_changes_and_exits_0(tiny_log):
    code, out, _ = memstep(
        "replay", str(tiny_log.path), "--set", "speculative_disable_by_batch_size=8", "--json"
    )
    assert code == 0
    report = json.loads(out)
    assert report["identical"] is False and report["exit_code"] == 0
    changes = {c["what"]: c for c in report["what_if"]["changes"]}
    assert changes["steps spec"]["replayed"] > changes["steps spec"]["recorded"]
    assert changes["requests finished"]["replayed"] == changes["requests finished"]["recorded"]


def test_what_if_with_a_planted_leak_shows_the_leak(tiny_log):
    code, text, _ = memstep(
        "replay", str(tiny_log.path), "--set", "debug_plant_leak=no_spec_hidden_states"
    )
    assert code == 0
    assert "what-if replay with debug_plant_leak=no_spec_hidden_states" in text
    assert "DIVERGED" not in text
    leak_rows = [line.split() for line in text.splitlines() if line.startswith("  leak reports")]
    assert leak_rows and leak_rows[0][2] == "0" and int(leak_rows[0][3]) >= 1
    assert "leak (replayed): step" in text and "no_spec live_growth" in text
