"""benchmarks/bench_tp.py at a tiny size on the CPU under gloo: every section's code (probe
ranks through capture, the logits comparison, throughput, the roofline table, the memory run
with every rank's reports) runs before the script meets two H200s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_tp.py"


@pytest.mark.slow  # 80-125 s on 2 cores; the TP must-shows have their own tests in make test
def test_the_tensor_parallel_benchmark_runs_end_to_end_on_a_cpu(tmp_path):
    argv = ["--out", str(tmp_path), "--model", "random:tiny", "--big-model", "random:tiny"]
    argv += ["--device", "cpu", "--dtype", "float32", "--num-threads", "1", "--sizes", "2,4"]
    argv += ["--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--max-model-len", "512"]
    argv += ["--prompt-len", "8", "--output-len", "4", "--memory-requests", "12"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench_tp.json").read_text())
    assert "errors" not in report
    versus = report["tp2_vs_tp1"]
    assert versus["same_argmax"] and versus["logits_within_tolerance"]
    assert versus["logits_max_abs_diff"] < 1e-4 * versus["logits_max_abs"] + 1e-6  # fp32
    assert [r["rank"] for r in report["probe_8b_tp2"]] == [0, 1]
    assert all(r["allreduce_ms"] > 0 for r in report["probe_8b_tp2"])
    two, one = report["probe_8b_tp2"][0], report["probe_8b_tp1"][0]
    assert two["kv_page_bytes"] * 2 == one["kv_page_bytes"], "KV heads split over the ranks"
    throughput = report["throughput_8b"]
    assert set(throughput["tp1"]) == set(throughput["tp2"]) == {"2", "4"}
    assert len(report["roofline_70b"]["ranks"]) == 2
    memory = report["memory_70b_tp2"]
    assert memory["requests"] == 12 and [r["rank"] for r in memory["ranks"]] == [0, 1]
    assert all(r["live_bytes"][0] > 0 for r in memory["ranks"])
