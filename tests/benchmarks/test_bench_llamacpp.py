"""benchmarks/bench_llamacpp.py with a stand-in llama-bench: llama.cpp runs in the environment
the command was given (memstep's passive OpenMP policy once slowed it from ~105 to ~41 tok/s),
and memstep once per wait policy and matmul precision, each in a process of its own."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_llamacpp.py"
FAKE = """#!/bin/sh
env > "{env_out}"
echo '[{{"n_prompt": 128, "n_gen": 0, "avg_ts": 300.0}},'
echo ' {{"n_prompt": 0, "n_gen": 64, "avg_ts": 100.0}}]'
"""


def test_llama_cpp_gets_the_caller_s_environment_and_memstep_runs_per_policy(tmp_path):
    env_out, fake = tmp_path / "llama_env.txt", tmp_path / "llama-bench"
    fake.write_text(FAKE.format(env_out=env_out))
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["MEMSTEP_TEST_MARK"] = "given"
    out = tmp_path / "rounds.json"
    argv = [sys.executable, str(SCRIPT), "--model", "random:tiny", "--threads", "1"]
    argv += ["--rounds", "1", "--llama-bench", str(fake), "--json", str(out)]
    argv += ["--matmul-precisions", "float32,bfloat16"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = dict(line.split("=", 1) for line in env_out.read_text().splitlines() if "=" in line)
    assert seen["MEMSTEP_TEST_MARK"] == "given"
    assert "OMP_WAIT_POLICY" not in seen and "GOMP_SPINCOUNT" not in seen
    (row,) = json.loads(out.read_text())["rounds"]
    for name in ("passive/float32", "passive/bfloat16", "spin/float32", "spin/bfloat16"):
        assert row[f"{name}_decode"] > 0 and row[f"{name}_concurrent_decode"] > 0
        # every token over the run: the prompts' 128 and the outputs' 64 a stream
        assert row[f"{name}_concurrent_all"] == pytest.approx(row[f"{name}_concurrent"] * 3)
        assert row[f"{name}_ratio_decode"] == row[f"{name}_decode"] / 100.0
        assert row[f"{name}_ratio_prefill"] == row[f"{name}_prefill"] / 300.0
        assert f"memstep {name}" in done.stdout


def test_the_memstep_children_start_under_their_wait_policy(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_llamacpp", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    assert bench.policy_env("passive")["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "GOMP_SPINCOUNT" not in bench.policy_env("passive")
    spin = bench.policy_env("spin")
    assert "OMP_WAIT_POLICY" not in spin and "GOMP_SPINCOUNT" not in spin  # libgomp's default
