"""1,000 distinct schemas, one after another (issue 55: 600 distinct 30 KB schemas took an
executor from 470 to 1,795 MB): the executor's compiled matchers stay within their cache's byte
budget, and so does the process's resident memory; the same run with a planted unbounded cache
grows past it, so the measure can fail.  The runs are made in a fresh process, the bounded one
first: freed heap of an earlier test would hide growth (the core's verdicts:
tests/core/test_constraint_cache_memory.py)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

from memstep.core.model_source import model_config, resolve
from memstep.executors.runtime.guide import GrammarBook

MIB = 1 << 20
UNBOUNDED = 1 << 40
BUDGET = 16 * MIB
SOURCE = resolve("smollm2")
MC = model_config(SOURCE)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def schema(k: int) -> str:
    """A distinct ~2 KB schema: 40 string properties named after `k`."""
    props = {f"field_{k}_{i}": {"type": "string", "maxLength": 20} for i in range(40)}
    return json.dumps({"type": "object", "properties": props, "required": [f"field_{k}_0"]})


def executor_growth(budget: int) -> dict:
    book = GrammarBook(SOURCE, MC.vocab_size, MC.eos_token_ids, budget_bytes=budget)
    for k in range(100):  # the tokenizer, the allocator's arenas: warm before measuring
        book.guide(("json", schema(k)))
    gc.collect()
    before = rss()
    for k in range(100, 1000):
        book.guide(("json", schema(k)))
    gc.collect()
    kept = len(book._compiled)
    return {"growth": rss() - before, "bytes": book.num_bytes, "kept": kept}


def in_a_fresh_process(path: str, function: str) -> list[dict]:
    """`function()` of the module at `path`, run in a fresh Python."""
    code = f"import json, runpy; print(json.dumps(runpy.run_path({path!r})[{function!r}]()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def growths() -> list[dict]:
    """The bounded run, then the planted unbounded one, in this process."""
    return [executor_growth(BUDGET), executor_growth(UNBOUNDED)]


def test_the_executors_matchers_stay_within_their_budget():
    bounded, planted = in_a_fresh_process(__file__, "growths")
    assert bounded["bytes"] <= BUDGET and bounded["kept"] < 1000
    assert bounded["growth"] < BUDGET + 16 * MIB, bounded
    # planted: every matcher kept (as before), which the same measure sees
    assert planted["kept"] == 1000 and planted["growth"] > 48 * MIB, planted
