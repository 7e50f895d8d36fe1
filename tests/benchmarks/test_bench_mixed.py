"""The benchmarks' ideal engine (benchmarks/common.py), worked by hand, their throughput runs on
random:tiny: each run feeds prompts of its own (repeated prompts were served from the prefix
cache, which made "warm" runs faster than an ideal engine)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from memstep.core.config import EngineConfig
from memstep.events.types import RequestFinished
from memstep.executors.process.inprocess import local_engine

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    """A benchmark script as a module, imported as its folder runs it (`common` beside it)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_the_ideal_engine_prefills_at_the_matmul_rate_then_decodes_at_each_steps_roofline():
    """2 layers, 1 KV head of 4 dims: 32 bytes of bf16 K and V a token. 1,000 weight bytes
    (500 parameters, 1,000 FLOPs a token); 100 B/s; 10,000 FLOP/s."""
    bench = load("common")
    model = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4)
    prompt, output = bench.PROMPT_LEN, bench.OUTPUT_LEN

    ideal = bench.ideal_run(2, model, 1000, 100.0, 10_000.0)

    prefill = 2 * prompt * 1000 / 10_000.0
    # each decode step reads the weights and 2 sequences' K and V; its FLOPs take 0.2 s
    decode = sum(max((1000 + 2 * (prompt + s) * 32) / 100.0, 0.2) for s in range(1, output))
    assert ideal["prefill_s"] == pytest.approx(prefill, abs=1e-4)
    assert ideal["decode_s"] == pytest.approx(decode, abs=1e-4)
    assert ideal["tok_per_s"] == pytest.approx(2 * output / (prefill + decode), abs=0.1)
    compute_bound = bench.ideal_run(2, model, 1000, 1e12, 10_000.0)
    assert compute_bound["decode_s"] == pytest.approx((output - 1) * 0.2, abs=1e-4)


@pytest.fixture(scope="module")
def tiny_engine():
    engine = local_engine(EngineConfig(model="random:tiny", num_threads=1, max_num_seqs=4))
    yield engine
    engine.shutdown()


def cached_tokens(engine, gpu, run: int) -> int:
    """Prompt tokens the prefix cache served in one throughput run of 2 requests."""
    finished: list[RequestFinished] = []
    engine.sinks.append(lambda r: isinstance(r, RequestFinished) and finished.append(r))
    clock = gpu.StepClock(engine)
    try:
        gpu.run_throughput(engine, clock, 2, engine.model_cfg.vocab_size, run)
    finally:
        clock.close()
        engine.sinks.pop()
    assert len(finished) == 2
    return sum(r.cached_tokens for r in finished)


def test_each_throughput_run_feeds_prompts_of_its_own(tiny_engine):
    gpu = load("common")
    assert cached_tokens(tiny_engine, gpu, 0) == 0
    assert cached_tokens(tiny_engine, gpu, 1) == 0
    # the same run again is what every repeat was before: its prompts come from the cache
    assert cached_tokens(tiny_engine, gpu, 1) >= gpu.PROMPT_LEN


def test_the_floor_adds_each_steps_kv_read_to_its_matmuls_and_meets_the_ideal_when_memory_bound():
    """bench_decode_floor: the same model as above; matmuls + head 0.5 s a step, K and V read
    at 100 B/s. With the matmuls at the weights' read time and nothing compute-bound, the
    floor is the ideal engine itself."""
    floor = load("bench_decode_floor")
    model = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4)
    prompt, output = floor.PROMPT_LEN, floor.OUTPUT_LEN

    run = floor.floor_run(2, model, 1000, 0.5, 100.0, 10_000.0)

    decode = sum(0.5 + 2 * (prompt + s) * 32 / 100.0 for s in range(1, output))
    assert run["prefill_s"] == pytest.approx(2 * prompt * 1000 / 10_000.0, abs=1e-4)
    assert run["decode_s"] == pytest.approx(decode, abs=1e-4)
    assert run["tok_per_s"] == pytest.approx(2 * output / (run["prefill_s"] + decode), abs=0.1)
    ideal = floor.ideal_run(2, model, 1000, 100.0, 1e12)
    memory_bound = floor.floor_run(2, model, 1000, 1000 / 100.0, 100.0, 1e12)
    assert memory_bound["tok_per_s"] == pytest.approx(ideal["tok_per_s"], rel=1e-4)
