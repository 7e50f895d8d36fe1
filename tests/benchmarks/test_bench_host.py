"""benchmarks/bench_host.py end to end on a tiny CPU engine: every part of a step is timed, and
the parts fit inside the step they belong to."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_host.py"


def test_it_splits_a_crowded_step_into_the_core_s_and_the_executor_s_parts():
    argv = [sys.executable, str(SCRIPT), "--model", "random:tiny", "--max-model-len", "512"]
    argv += ["--running", "40", "--new", "2", "--steps", "4", "--max-num-seqs", "64"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    ms = {k: float(v) for k, v in re.findall(r"^\s+(\w+)\s+([\d.]+) ms$", res.stdout, re.M)}
    parts = ["core_plan", "core_schedule", "core_record", "build_batch", "forward_host"]
    parts += ["sample_rows", "memory_measure", "executor", "step"]
    assert set(parts) <= ms.keys(), res.stdout
    assert ms["core_schedule"] <= ms["core_plan"] and ms["forward_host"] <= ms["executor"]
    assert ms["core_plan"] + ms["executor"] + ms["core_record"] <= ms["step"] * 1.5  # medians
    assert re.search(r"random:tiny: \d+ running, 2 new a step", res.stdout)
