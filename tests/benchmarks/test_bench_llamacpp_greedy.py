"""benchmarks/bench_llamacpp_greedy.py with a stand-in llama-completion: llama.cpp's text and
`eval time` line are read, memstep's greedy tokens counted against that text from the first."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_llamacpp_greedy.py"
FAKE = """#!/bin/sh
printf 'no such continuation'
echo 'llama_perf_context_print:        eval time =      80.00 ms /     8 runs   \
(   10.00 ms per token,   123.45 tokens per second)' >&2
"""


def test_llama_cpp_s_speed_is_read_and_memstep_s_tokens_counted(tmp_path):
    fake = tmp_path / "llama-completion"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    out = tmp_path / "greedy.json"
    argv = [sys.executable, str(SCRIPT), "--model", "random:tiny", "--threads", "1"]
    argv += ["--tokens", "4", "--llama-completion", str(fake), "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["prompts"]
    assert len(rows) == 4
    for row in rows:
        assert row["llama_decode"] == 123.45 and row["memstep_decode"] > 0
        assert row["tokens"] == 4 and row["agreed"] == 0  # random weights: not that text
    assert "ratio" in done.stdout


def test_agreement_counts_tokens_from_the_first_until_the_texts_part(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # it imports bench_llamacpp beside it
    spec = importlib.util.spec_from_file_location("bench_llamacpp_greedy", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.agreed([" Paris", " Paris.", " Paris. It"], " Paris. It is") == 3
    assert bench.agreed([" Paris", " Paris,", " Paris, the"], " Paris. It is") == 1
    assert bench.agreed([" Lyon"], " Paris") == 0
