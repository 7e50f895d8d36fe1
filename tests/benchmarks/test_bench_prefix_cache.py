"""benchmarks/bench_prefix_cache.py at a tiny size: the whole script on random:tiny (ShareGPT on
and off, side by side, the bookkeeping alone), and the recorded block-manager trace, whose replay
must give the answers the engine got and says so when it does not."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from memstep.core.config import EngineConfig

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_prefix_cache.py"
TINY = EngineConfig(model="random:tiny", num_threads=1)
ARGS = argparse.Namespace(num_sharegpt=12, max_tokens=6, seed=0, dataset="sharegpt")


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_prefix_cache", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_bench()


@pytest.fixture(scope="module")
def trace(bench):
    return bench.record_trace(TINY, ARGS)


def test_the_benchmark_runs_end_to_end_at_a_tiny_size(tmp_path):
    out = tmp_path / "figures.json"
    argv = ["--model", "random:tiny", "--num-threads", "1", "--num-sharegpt", "8"]
    argv += ["--max-tokens", "4", "--workloads", "sharegpt,paired,bookkeeping", "--repeats", "2"]
    argv += ["--bookkeeping-reps", "3", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["sharegpt"]["on"]) == len(report["sharegpt"]["off"]) == 2
    assert all(r["cached_prompt_tokens"] == 0 for r in report["sharegpt"]["on"])
    assert report["paired"]["same_plans"] and report["paired"]["num_steps"] > 1
    assert report["bookkeeping"]["on_calls_step"] > report["bookkeeping"]["off_calls_step"] > 0
    assert "caching costs" in done.stdout and "plans identical: True" in done.stdout


def test_a_trace_replays_with_the_answers_the_engine_got(bench, trace):
    kinds = {call[0] for call in trace["calls"]}
    assert {"lookup", "allocate", "ensure", "commit", "free", "table", "figures"} <= kinds
    assert not any(call[2] for call in trace["calls"] if call[0] == "lookup"), "ShareGPT hit"
    for caching in (True, False):
        blocks = bench.replay_trace(trace, caching)
        blocks.check()
        blocks.check_idle()  # every request freed its pages, as in the engine
        assert (blocks.num_cached > 0) == caching


def test_replay_says_when_an_answer_differs(bench, trace):
    hit = copy.deepcopy(trace)
    lookup = next(call for call in hit["calls"] if call[0] == "lookup")
    lookup[2] = 1  # planted: the engine found a cached block
    with pytest.raises(AssertionError, match="a hit differs"):
        bench.replay_trace(hit, True)
    refused = copy.deepcopy(trace)
    allocate = next(call for call in refused["calls"] if call[0] == "allocate")
    allocate[3] = False  # planted: the engine was refused its pages
    with pytest.raises(AssertionError, match="an allocation differs"):
        bench.replay_trace(refused, False)


def test_caching_does_measurable_work_on_the_trace(bench, trace):
    b = bench.time_bookkeeping(trace, reps=2)
    assert b.on_calls_step > b.off_calls_step > 0  # hashing and caching full blocks
    assert b.on_step_us > 0 and b.off_step_us > 0 and b.median_step_ms > 0
