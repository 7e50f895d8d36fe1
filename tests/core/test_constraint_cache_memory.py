"""1,000 distinct 100 KB schemas checked one after another: the core's constraint verdicts (keyed
by the schema's text) stay within their cache's byte budget, and so does the process's resident
memory; a planted unbounded cache grows past it, so the measure can fail.  Both runs are made
in a fresh process, the bounded one first: freed heap of an earlier test would hide growth."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

from memstep.core.grammar import ConstraintBook

MIB = 1 << 20
BUDGET = 16 * MIB


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def big_schema(k: int) -> str:
    """A distinct 100 KB schema that compiles at once (its bulk is a description)."""
    return json.dumps({"type": "string", "description": f"{k} " + "x" * 100_000})


def core_growth(budget: int) -> dict:
    book = ConstraintBook(budget_bytes=budget)
    try:
        assert book.error("json", big_schema(0)) == ""  # the check worker started
        gc.collect()
        before = rss()
        assert all(book.error("json", big_schema(k)) == "" for k in range(1, 1000))
        gc.collect()
        return {"growth": rss() - before, "bytes": book.verdicts.num_bytes}
    finally:
        book.close()


def growths() -> list[dict]:
    """The bounded run, then the planted unbounded one, in this process."""
    return [core_growth(BUDGET), core_growth(1 << 40)]


def test_the_cores_verdicts_stay_within_their_budget():
    code = f"import json, runpy; print(json.dumps(runpy.run_path({__file__!r})['growths']()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    bounded, planted = json.loads(done.stdout.strip().splitlines()[-1])
    assert bounded["bytes"] <= BUDGET and bounded["growth"] < BUDGET + 16 * MIB, bounded
    assert planted["growth"] > 75 * MIB, planted  # (planted: every text kept, as before)
