"""What the benchmarks share: the device's ceilings (copy bandwidth, matmul rate), timed CUDA
calls and kernel profiles, the engine's decode feeds and step clock, a throughput run, and the
ideal engine that bench_mixed and bench_decode_floor measure against.

Benchmarks run as scripts (`python benchmarks/bench_X.py`), whose folder Python puts first on
the path: each imports this module as `common`, and memstep as installed (`make install`) or
from a PYTHONPATH holding a `memstep` link to the checkout.
"""

from __future__ import annotations

import os
import random
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MODEL = "random:llama-3.1-8b"
PROMPT_LEN, OUTPUT_LEN = 128, 128
CONTEXT = PROMPT_LEN + OUTPUT_LEN // 2  # decode steps are timed at the run's middle context


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.randn(2 * 2**30 // 4, device="cuda")  # 2 GiB of fp32
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 20, warmup=3)
    return 2 * src.numel() * 4 / (ms / 1e3)


def matmul_rate() -> float:
    """bf16 8192^3 matrix product on random data, FLOP/s."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, 20, warmup=3)
    return 2 * n**3 / (ms / 1e3)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def median_ms(
    fn: Callable[[], object], iters: int, l2_flush: torch.Tensor | None = None, warmup: int = 5
) -> float:
    """Median milliseconds of fn() over `iters` runs, timed with CUDA events, after `warmup`
    runs (compile and allocate outside the timing); `l2_flush` is zeroed before each run."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if l2_flush is not None:
            l2_flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


_INHERITED = object()  # a wrapped method that its object did not hold itself (its class's)


class StepClock:
    """Wall time per engine step, split into executor model forward, sampler and the rest."""

    def __init__(self, engine):
        self.engine = engine
        self.records: list[dict] = []
        self._parts: dict[str, float] = {}
        self._wrapped: list[tuple[object, str, object]] = []
        worker = engine.executor.worker
        self.wrap(worker, "forward")
        self.wrap(worker.sampler, "distribution", "sampler")
        self.wrap(worker.sampler, "sample", "sampler")
        self.wrap(worker, "execute", "worker_execute")
        self.wrap(engine.executor, "execute", "executor_execute")

    def wrap(self, obj, name: str, key: str | None = None) -> None:
        """Time `obj.name` (a method, or a module's function) into each step's record as `key`."""
        inner = getattr(obj, name)
        key = key or name
        own = vars(obj).get(name, _INHERITED)  # a module's function, or an instance's own

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._parts[key] = self._parts.get(key, 0.0) + time.perf_counter() - start

        setattr(obj, name, timed)
        self._wrapped.append((obj, name, own))

    def close(self) -> None:
        """Unwrap: the engine's methods are its own again, and nothing here holds it."""
        for obj, name, own in reversed(self._wrapped):
            if own is _INHERITED:
                delattr(obj, name)
            else:
                setattr(obj, name, own)
        self._wrapped.clear()

    def step(self):
        self._parts = {}
        batch = len(self.engine.scheduler.running)
        start = time.perf_counter()
        outputs = self.engine.step()
        total = time.perf_counter() - start
        self.records.append({"batch": batch, "total": total, **self._parts})
        return outputs


def decode_breakdown(records: list[dict], batch: int) -> dict:
    rows = [r for r in records if r["batch"] == batch and "forward" in r]
    if not rows:
        return {}
    keys = ("total", "forward", "sampler", "worker_execute", "executor_execute")
    med = {k: statistics.median(r.get(k, 0.0) for r in rows) * 1e3 for k in keys}
    return {
        "steps": len(rows),
        "step_ms": round(med["total"], 2),
        "forward_ms": round(med["forward"], 2),
        "sampler_ms": round(med["sampler"], 2),
        "rest_of_executor_ms": round(med["worker_execute"] - med["forward"] - med["sampler"], 2),
        "codec_ms": round(med["executor_execute"] - med["worker_execute"], 2),
        "engine_core_ms": round(med["total"] - med["executor_execute"], 2),
    }


def run_throughput(engine, clock: StepClock, batch: int, vocab: int, run: int = 0) -> dict:
    """`batch` requests of PROMPT_LEN random tokens + OUTPUT_LEN, all at once. Each `run`
    gets prompts of its own: repeated prompts would be prefix-cache hits, prefill skipped."""
    from memstep.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    for prompt in random_prompts(batch, PROMPT_LEN, vocab, 1000 * (run + 1) + batch):
        engine.add_request(prompt, params)
    clock.records.clear()
    if torch.cuda.is_available():  # a CPU engine runs it in the suite
        torch.cuda.synchronize()
    start = time.perf_counter()
    produced = 0
    while engine.has_work():
        produced += sum(len(out.new_token_ids) for out in clock.step())
    seconds = time.perf_counter() - start
    assert produced == batch * OUTPUT_LEN, produced
    return {
        "tok_per_s": round(produced / seconds, 1),
        "seconds": round(seconds, 3),
        "steps": len(clock.records),
        "decode_steps": decode_breakdown(clock.records, batch),
        "first_steps_ms": [round(r["total"] * 1e3, 1) for r in clock.records[:8]],
        "non_decode_seconds": round(
            sum(r["total"] for r in clock.records if r["batch"] != batch), 3
        ),
    }


def decode_feeds(batch: int, context: int, block_size: int):
    from memstep.core.shapes import cdiv
    from memstep.events.plan import SeqPlan

    pages = cdiv(context + 1, block_size)
    return [
        (
            SeqPlan(f"b{i}", context, [5], list(range(i * pages, (i + 1) * pages)), True, 0, 0),
            [5],
        )
        for i in range(batch)
    ]


def model_step_ms(worker, batch: int, context: int) -> dict:
    """Graph replay (+ the lm_head, run eagerly after it) for `batch` decodes at `context`."""
    runner = worker.graphs
    runner.drop_ahead()  # replays here overwrite the decode buffers
    feeds = decode_feeds(batch, context, worker.cfg.block_size)
    with torch.inference_mode():
        runner.inputs.fill(feeds, runner.padded_size(batch))
        graph = runner.graphs[runner.padded_size(batch)]
        hidden = runner.decode.hidden[:batch]
        replay = median_ms(graph.replay, 50, warmup=3)
        step = median_ms(lambda: (graph.replay(), worker.model.logits(hidden)), 50, warmup=3)
    return {"graph_ms": round(replay, 3), "graph_plus_head_ms": round(step, 3)}


def kernel_times(fn, runs: int) -> list[dict]:
    """CUDA time and calls per kernel name, per run of fn, over `runs` profiled runs; the
    costliest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us: float = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if us > 0:
            rows.append(
                {
                    "kernel": event.key[:90],
                    "ms_per_run": us / runs / 1e3,
                    "calls_per_run": event.count / runs,
                }
            )
    rows.sort(key=lambda r: -r["ms_per_run"])
    return rows


def kernel_profile(worker, batch: int, context: int) -> list[dict]:
    """CUDA time per kernel name over 5 eager runs of the fused decode forward at `batch`."""
    runner = worker.graphs
    runner.drop_ahead()  # runs here overwrite the decode buffers
    size = runner.padded_size(batch)
    with torch.inference_mode():
        runner.inputs.fill(decode_feeds(batch, context, worker.cfg.block_size), size)
        runner.decode(size)
        rows = kernel_times(lambda: runner.decode(size), 5)
    return [
        {
            "kernel": r["kernel"],
            "ms_per_step": round(r["ms_per_run"], 4),
            "calls_per_step": r["calls_per_run"],
        }
        for r in rows[:15]
    ]


def ideal_run(batch: int, model_cfg, weight_bytes: int, bandwidth: float, rate: float) -> dict:
    """An ideal engine's time for `batch` requests of PROMPT_LEN + OUTPUT_LEN tokens: the
    prompts' FLOPs at the matmul rate (their first tokens with them), then OUTPUT_LEN - 1
    decode steps each at its roofline."""
    m = model_cfg
    flops_per_token = weight_bytes  # bf16: 2 bytes a parameter, 2 FLOPs a parameter
    prefill = batch * PROMPT_LEN * flops_per_token / rate
    kv_per_token = m.num_layers * 2 * m.num_kv_heads * m.head_dim * 2  # bf16 K and V
    decode = 0.0
    for step in range(1, OUTPUT_LEN):
        read = weight_bytes + batch * (PROMPT_LEN + step) * kv_per_token
        decode += max(read / bandwidth, batch * flops_per_token / rate)
    seconds = prefill + decode
    return {
        "prefill_s": round(prefill, 4),
        "decode_s": round(decode, 4),
        "tok_per_s": round(batch * OUTPUT_LEN / seconds, 1),
    }


TICKS = os.sysconf("SC_CLK_TCK")
PROCESSES = ("core", "executor", "http")  # a `memstep serve`'s roles


def server_pids(info: dict[str, Any]) -> dict[str, list[int]]:
    """The processes of a `memstep serve` by role, from its ready file (every HTTP front)."""
    pids = {name: [int(info.get(f"{name}_pid") or 0)] for name in PROCESSES}
    pids |= {"http": [int(pid) for pid in info.get("http_pids") or pids["http"]]}
    return {name: [pid for pid in group if pid] for name, group in pids.items()}  # 0: none


def cpu_seconds(pids: dict[str, list[int]]) -> dict[str, float]:
    """User + system CPU seconds of each server role's processes so far, and of this client."""
    out = {}
    for name, group in pids.items():
        out[name] = 0.0
        for pid in group:  # server_pids left out the roles a server does not run (pid 0)
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] += (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime
    me = resource.getrusage(resource.RUSAGE_SELF)
    return out | {"client": me.ru_utime + me.ru_stime}
