"""benchmarks/bench_capacity.py: the ideal engine worked by hand, the rate search on a stand-in
run, and the whole script on the CPU (`--quick`) with a real server over ZMQ and HTTP."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memstep.cli.datasets import Sample
from memstep.core.model_config import ModelConfig

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# 1 layer: attention 4*2*(2*2 + 2*1) = 48, MLP 3*4*8 = 96, head 10*4 = 40 -> 184 parameters
MC = ModelConfig(
    num_layers=1,
    hidden_size=4,
    intermediate_size=8,
    num_heads=2,
    num_kv_heads=1,
    vocab_size=10,
    head_dim=2,
)
FLOPS = 2 * 184  # a token's FLOPs; also the weights' bytes in bf16
LOAD = {"prompt": 10.0, "output": 5.0, "context": 20.0}  # KV: 1 layer * 2 * 1 head * 2 * 2 = 8 B


@pytest.fixture(scope="module")
def cap():
    sys.path.insert(0, str(BENCHMARKS))  # its neighbours, as when run as a script
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_capacity", BENCHMARKS / "bench_capacity.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_the_ideal_engine_worked_by_hand(cap):
    rates = {"matmul_flops": FLOPS * 100.0, "read_bytes_s": FLOPS * 10.0}
    got = cap.ideal_capacity(MC, 2, rates, LOAD, tpot_s=0.5)
    # prefill 10 * 368 / 36,800 = 0.1 s a request; 2 steps a second read 2 * 368 / 3,680 = 0.2
    # s of weights; KV 5 * 20 * 8 / 3,680 s a request: (1 - 0.2) / (0.1 + 0.2174) = 2.52 req/s;
    # matmuls 1 / (0.1 + 5 * 368 / 36,800) = 6.67 req/s
    assert got["capacity_req_s"] == pytest.approx(2.52, abs=0.01) and got["bound"] == "reads"
    assert got["pace_batch"] == 9  # min((0.5 * 3,680 - 368) / (20 * 8), 0.5 * 36,800 / 368)
    faster = cap.ideal_capacity(MC, 2, rates | {"read_bytes_s": FLOPS * 20.0}, LOAD, 0.5)
    assert faster["capacity_req_s"] == pytest.approx(4.31, abs=0.01)  # (1 - 0.1) / (0.1 + 0.1087)
    slow_matmuls = cap.ideal_capacity(MC, 2, rates | {"matmul_flops": FLOPS * 5.0}, LOAD, 0.5)
    assert slow_matmuls["bound"] == "matmuls"  # reads: (1 - 0.2) / (2 + 0.2174) = 0.36 req/s
    assert slow_matmuls["capacity_req_s"] == pytest.approx(0.33, abs=0.01)  # 1 / (2 + 1)


def test_the_kernel_floor_times_the_models_own_shapes_below_the_peak(cap, monkeypatch):
    """The floor's rate: every matmul of the model (each layer's four and the head) timed at
    each row count; its FLOPs over the time, the best row count's. With every product made to
    take a known time, the rate is the FLOPs of the tokens over those times."""
    timed: list[tuple[int, ...]] = []

    def fake_seconds(fn, device):
        out = fn()
        timed.append(tuple(out.shape))
        return 1e-3 * out.shape[0]  # a millisecond a row, whatever the shape

    monkeypatch.setattr(cap, "kernel_seconds", fake_seconds)
    rate = cap.model_matmul_rate(MC, "cpu", 4)
    rows = cap.FLOOR_TOKENS
    # 5 products a row count: qkv (4 -> 2*(2+2)=8), o (4 -> 4), gate+up (4 -> 16), down (8 -> 4)
    # and the head (4 -> 10); one layer, so 5 ms a row: 2 * 184 FLOPs / 5 ms at every count
    assert sorted({s[1] for s in timed}) == [4, 8, 10, 16] and len(timed) == 5 * len(rows)
    assert rate == pytest.approx(FLOPS / 5e-3)
    peak = {"matmul_flops": 2 * rate, "read_bytes_s": 1e9}  # a peak twice what shapes reach
    ideal = cap.ideal_capacity(MC, 2, peak, LOAD, 0.5)
    floor = cap.ideal_capacity(MC, 2, peak | {"matmul_flops": rate}, LOAD, 0.5)
    assert floor["bound"] == "matmuls" and floor["capacity_req_s"] < ideal["capacity_req_s"]


def test_the_workload_means_count_each_reply_tokens_context(cap):
    w = cap.workload([Sample("a", 3, 2), Sample("b", 5, 4)])
    assert (w["prompt"], w["output"]) == (4.0, 3.0)
    assert w["context"] == pytest.approx((3 + 4 + 5 + 6 + 7 + 8) / 6)


def test_the_search_doubles_then_bisects_to_the_highest_rate_that_met_the_slo(cap, monkeypatch):
    tried: list[float] = []

    def fake_run(url, backend, rate, samples, ctx, label=""):
        tried.append(rate)
        return {"rate": rate, "meets": rate <= 11}

    monkeypatch.setattr(cap, "one_run", fake_run)
    args = argparse.Namespace(rate_start=4.0, rate_max=512.0, bisect=3, seconds=0.0)
    got = cap.search("u", "zmq", [], {"args": args})
    assert tried == [4, 8, 16, 12, 10, 11]
    assert got["capacity_req_s"] == 11 and got["first_miss"] == 12
    assert got["at_capacity"]["rate"] == 11
    tried.clear()
    never = cap.search(
        "u",
        "zmq",
        [],
        {"args": argparse.Namespace(rate_start=32, rate_max=512, bisect=2, seconds=0.0)},
    )
    assert tried == [32, 16, 8] and never["capacity_req_s"] == 8 and never["first_miss"] == 16
    tried.clear()
    capped = cap.search(
        "u",
        "zmq",
        [],
        {"args": argparse.Namespace(rate_start=8, rate_max=12, bisect=0, seconds=0.0)},
    )
    assert tried == [8, 12] and capped["capacity_req_s"] == 8 and capped["first_miss"] == 12


def test_each_rate_runs_for_the_seconds_asked_repeating_the_sample(cap):
    sample = [Sample(f"p{i}", 4, 8) for i in range(3)]
    assert cap.sustained(sample, rate=2.0, seconds=0.0) == sample  # never fewer than the sample
    got = cap.sustained(sample, rate=2.5, seconds=3.0)
    assert [s.prompt for s in got] == ["p0", "p1", "p2", "p0", "p1", "p2", "p0", "p1"]


def test_the_batch_watch_reads_the_running_batch_and_the_queue_until_the_run_ends(cap):
    replies = iter([(0, 0), (3, 0), (5, 2), (4, 7), (0, 0)])
    seen = []

    def stats():
        running, waiting = next(replies, (0, 0))
        seen.append(running)
        return argparse.Namespace(num_running=running, num_waiting=waiting)

    with cap.BatchWatch(stats, interval=0.01) as watch:
        while len(seen) < 5:
            time.sleep(0.01)
    assert watch.figures() == {"running_peak": 5, "running_mean": 4.0, "waiting_peak": 7}
    assert cap.BatchWatch(stats).figures()["running_peak"] == 0  # never read: no figures


def test_overload_counts_typed_refusals_and_admitted_requests_cut_short(cap, monkeypatch):
    from memstep.cli.bench_serve import RequestResult

    asked = [Sample(f"p{i}", 4, 8) for i in range(5)]
    results = [
        RequestResult(prompt_len=4, output_len=8),
        RequestResult(prompt_len=4, output_len=5),  # admitted, then cut short: lost
        RequestResult(error="overloaded: 9 requests wait (limit 8)"),
        RequestResult(error='HTTP 503 (Retry-After 1): {"error": {"code": "overloaded"}}'),
        RequestResult(error="HTTP 500: internal_error"),  # a refusal that is not typed
    ]

    def fake_run(url, backend, rate, samples, ctx, label=""):
        ctx["last"] = (results, asked)
        return {"rate": rate, "output_throughput": 90.0, "mean_tpot_ms": 30.0}

    monkeypatch.setattr(cap, "one_run", fake_run)
    found = {"at_capacity": {"rate": 10.0, "output_throughput": 100.0, "mean_tpot_ms": 20.0}}
    ctx = {"args": argparse.Namespace(overload_prompts=5)}
    got = cap.overload("u", "zmq", found, asked, ctx)
    assert got["rate"] == 20.0 and got["served_of_capacity"] == 0.9
    assert got["tpot_of_capacity"] == 1.5 and got["refused"] == 3
    assert got["untyped_refusals"] == ["HTTP 500: internal_error"] and got["admitted_lost"] == 1
    assert not cap.is_typed_refusal("HTTP 503: recovering") and cap.is_typed_refusal(
        "overloaded: x"
    )


def test_quick_runs_on_the_cpu_over_zmq_and_http_then_at_twice_capacity(tmp_path):
    """A CPU capacity over both backends, then twice it with a waiting bound of one request."""
    flags = "--num-threads 1 --max-num-seqs 2 --max-waiting-requests 1"
    argv = ["--quick", "--rate-start", "16", "--overload-prompts", "12", "--engine-flags", flags]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_capacity.py"), *argv, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "bench_capacity.json").read_text())
    assert report["workload"]["num_prompts"] == 12 and report["slo_ms"]["p99_ttft"] == 2000
    for backend in ("zmq", "openai"):
        got, over = report[backend], report[backend]["overload"]
        assert got["capacity_req_s"] > 0 and got["at_capacity"]["meets"]
        assert 0 <= got["at_capacity"]["running_peak"] <= 2  # --max-num-seqs 2, read by stats
        assert over["rate"] == 2 * got["capacity_req_s"]
        assert over["completed"] + over["refused"] == 12 and over["completed"] > 0
        assert over["untyped_refusals"] == [] and over["admitted_lost"] == 0
    assert sum(r["cpu_s"]["http"] for r in report["openai"]["runs"]) > 0  # the front worked
    assert report["ideal"]["capacity_req_s"] > 0 and report["ideal"]["device"] == "cpu"
    floor = report["ideal"]["floor"]
    assert floor["capacity_req_s"] > 0 and floor["matmul_flops"] > 0
    assert "of the kernel floor" in done.stdout
    assert "ideal engine on cpu" in done.stdout and "openai at 2x" in done.stdout


def test_ideal_only_serves_nothing_and_prints_the_floor_beside_the_ideal(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_capacity.py"), "--quick", "--ideal-only"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ideal engine on cpu" in done.stdout and "kernel floor" in done.stdout
    assert "zmq:" not in done.stdout and not (tmp_path / "bench_capacity_out").exists()
