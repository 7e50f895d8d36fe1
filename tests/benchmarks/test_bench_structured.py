"""benchmarks/bench_structured.py --quick end to end, on the path of the H200 run (a random
model with SmolLM2's tokenizer): both mixes run, and the compile figures count each distinct
schema once."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_structured.py"


def test_quick_run_prints_both_mixes_and_the_compile_cache():
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    # the H200 command's path: a random model with SmolLM2's tokenizer (not random:tiny's bytes)
    assert re.search(r"^random:tiny \(random weights\) with the tokenizer of SmolLM2", out, re.M)
    assert float(re.search(r"^plain\s+([\d.]+) tok/s", out, re.M).group(1)) > 0, out
    assert float(re.search(r"^half schemas\s+([\d.]+) tok/s", out, re.M).group(1)) > 0, out
    # 4 streams: requests 1 and 3 carry schemas 0 and 1; the warm-up compiles both, the
    # round's two requests hit the cache
    assert re.search(r"grammars compiled 2, [\d.]+ ms each; cache hit rate 0.500", out), out
    share = float(re.search(r"^mask\s+([\d.]+) of the constrained", out, re.M).group(1))
    assert 0.0 < share < 1.0, out
