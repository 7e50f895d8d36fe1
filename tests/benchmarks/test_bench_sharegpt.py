"""benchmarks/bench_sharegpt.py at a tiny size on the CPU: a real server process with its log
kept, a real bench client, the table, the memory verdict from the log, inspect and the plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_sharegpt.py"


def test_the_sharegpt_benchmark_runs_end_to_end_at_a_tiny_size(tmp_path):
    prompts = [f"Question {i}: why does memory creep up after graph capture?" for i in range(20)]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps({"prompt": p, "output_len": 8}) for p in prompts))
    out = tmp_path / "out"
    argv = ["--out", str(out), "--model", "random:tiny", "--dataset", str(dataset)]
    argv += ["--num-prompts", "20", "--request-rate", "20", "--configs", "default"]
    argv += ["--engine-flags", "--num-threads 1", "--backends", "zmq,openai"]
    argv += ["--serve-flags", "--api-server-count 2"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=600
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: a memory verdict that failed
    assert "Serving Benchmark Result" in done.stdout and "out tok/s" in done.stdout
    result = json.loads((out / "default.result.json").read_text())
    bench, memory = result["bench"], result["memory"]
    assert (bench["completed"], bench["failed"], bench["total_output_tokens"]) == (20, 0, 160)
    assert bench["limits"] == [16, 512]  # the CPU's defaults
    assert memory["predicted_peak"] > 0 and memory["num_steps"] > 8
    assert memory["segments"][0] > 0 and memory["reserved"][2] >= memory["reserved"][0]
    assert memory["flat"] == (done.returncode == 0)
    assert (out / "default.png").stat().st_size > 10_000
    assert (out / "default.plan.png").stat().st_size > 10_000
    inspect = json.loads((out / "default.inspect.json").read_text())
    assert inspect["log"]["header"]["config"]["tokenizer"] == str(out / "tokenizer.json")
    table = (out / "table.txt").read_text()
    assert "default" in table.splitlines()[2]
    assert "vLLM: workload 1,582,725 input / 1,442,778 output tokens asked" in table
    http = result["backends"]["openai"]  # the same load over the same server's HTTP front
    assert (http["completed"], http["failed"], http["total_output_tokens"]) == (20, 0, 160)
    assert "default over openai:" in table and "/ ZMQ: mean_ttft_ms" in table
    assert f"default: workload {bench['workload_input_tokens']:,} input / 160 output" in table
