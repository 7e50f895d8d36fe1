"""benchmarks/bench_replicas.py on the CPU: a replica killed under a small load costs no request,
its requests migrate, and the survivor's memory is read as flat only when it is."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_replicas", BENCHMARKS / "bench_replicas.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_kill_run_migrates_and_fails_no_request():
    bench = _bench()
    args = bench.parse(["--quick", "--num-prompts", "16", "--kill-at", "0.5"])
    assert (args.model, args.num_prompts, args.kill_at, args.request_rate) == (
        "random:tiny",
        16,
        0.5,
        20.0,
    )
    label, flags, kill, env = bench.plan(args)[0]
    out = bench.run_one(label, flags, bench.samples_of(args), args, kill, env)
    assert (out["completed"], out["failed"]) == (16, 0)
    assert out["migrations"] > 0 and out["migrated_finished"] == out["migrations"]
    assert 0 < out["pause_max_s"] < 5
    assert out["memory"]["1"]["reserved_growth"] == 0 and out["memory"]["1"]["samples"] >= 1


def test_memory_that_grows_is_not_flat():
    bench = _bench()
    sampler = bench.MemorySampler("tcp://127.0.0.1:1")
    for t, reserved in enumerate([100, 100, 164]):
        figures = {"memory_reserved_bytes": reserved, "memory_live_bytes": 50}
        sampler.samples.append((float(t), "1", figures))
    assert sampler.survivor("1")["reserved_growth"] == 64


def test_each_mode_plans_its_runs():
    bench = _bench()
    two = bench.plan(bench.parse(["--two-gpus"]))
    assert [env["CUDA_VISIBLE_DEVICES"] for _, _, _, env in two] == ["0", "0,1"]
    cpu = bench.plan(bench.parse(["--cpu-threads"]))
    assert [flags[-1] for _, flags, _, _ in cpu] == ["1", "2"]
    assert "--data-parallel-size" in cpu[0][1] and "--data-parallel-size" not in cpu[1][1]
    h200 = bench.parse([])
    assert (h200.num_prompts, h200.request_rate, h200.device) == (7200, 60.0, "cuda")


@pytest.mark.gpu
def test_two_replicas_share_one_gpu_through_a_kill():
    """On a GPU: two replicas of random:tiny at half the memory each, one core killed under
    load; no request fails and the survivor's reserved memory does not grow."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    bench = _bench()
    args = bench.parse(["--quick", "--device", "cuda", "--num-prompts", "64", "--kill-at", "1.5"])
    label, flags, kill, env = bench.plan(args)[0]
    out = bench.run_one(label, flags, bench.samples_of(args), args, kill, env)
    assert (out["completed"], out["failed"]) == (64, 0) and out["migrations"] > 0
    survivor = out["memory"]["1"]
    assert survivor["samples"] >= 2 and survivor["reserved_growth"] == 0, survivor
