"""benchmarks/bench_spec.py at a small size on the CPU (SmolLM2 q4, one thread): the edit
workload has n-gram drafts accepted, and every request gives the tokens of plain decoding."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_spec.py"


def test_an_edit_workload_has_drafts_accepted_and_the_tokens_of_plain_decoding():
    argv = ["--methods", "none,ngram", "--workloads", "edit", "--concurrency", "1"]
    argv += ["--rounds", "1", "--tokens", "24", "--threads", "1", "--k", "3"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(
        r"^(none|ngram)\s+edit\s+1\s+[\d.]+\s+([\d.]+)x\s+([\d.]+)\s+([\d.]+)\s+(\d+)/(\d+)\s+([\d.]+)\s+([\d.]+)$",
        done.stdout,
        re.M,
    )
    assert [r[0] for r in rows] == ["none", "ngram"], done.stdout
    (_, base, *_), (_, _, rate, mean_len, same, total, ms, choice_us) = rows
    assert float(base) == 1.0 and float(rate) > 0 and float(mean_len) > 0 and float(ms) > 0
    assert float(choice_us) > 0, "the threshold and adaptive K are timed at every ngram step"
    assert same == total == "2", "greedy drafts verified change no token"
