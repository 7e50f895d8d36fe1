"""Tensor parallelism on two H200s: TP=2 against TP=1 in one run, and Llama-3.1-70B at TP=2.

    python benchmarks/bench_tp.py [--out DIR] [--memory-requests 2000]

Sections (each a `section` entry of `bench_tp.json`; a failing one is recorded, the rest run):

* `probe_8b_tp1`, `probe_8b_tp2`: random:llama-3.1-8b in bf16 as one rank, then two.  Each rank
  is a worker in its own process (`--probe`, started here) that goes through profile, warmup
  and capture, then measures: one fixed prompt's logits, the batch-1 decode step (a captured
  graph with its all-reduces inside, and the head with its logits all-gather), one decode
  token's all-reduce, the logits all-gather, its weight bytes and the copy bandwidth.
* `tp2_vs_tp1`: the logits' max abs difference (tolerance: 2% of the largest logit, and the same
  argmax: bf16 keeps ~3 digits and TP=2 sums each row-parallel matmul in another order), and the
  batch-1 step ratio (target <= 0.6).
* `throughput_8b`: output tokens/s at 64 and 256 concurrent requests (128 prompt + 128 output
  tokens), TP=1 and TP=2, both through the process executor.
* `probe_70b_tp2` and `roofline_70b`: random:llama-3.1-70b at TP=2: the batch-1 step against
  each GPU's weight-read roofline (its shard's bytes, the embedding slice aside, at the copy
  bandwidth) plus the measured all-reduce time of a step (2 per layer + the embedding's, and
  the logits all-gather); target <= 1.3x.
* `allreduce_sweep`: NCCL all-reduce of [rows, hidden] activations (rows 1, 64, 256; hidden
  4096 and 8192), the figures docs/tensor_parallel.md leaves marked for the H200s
  (`--allreduce-sweep 2` runs only this).
* `memory_70b_tp2`: >= 2,000 requests of random sampling at rising concurrency after capture;
  every rank's reserved and live bytes (each StepResult carries every rank's report) at the
  first serving step and at the last: allocator growth after capture on both ranks (target 0).

`--model`, `--device cpu`, `--dtype float32` and the small sizes make the same code run on a
CPU under gloo (tests/benchmarks/test_bench_tp.py does), so that the GPU run goes through
code that has run before.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN, OUTPUT_LEN = 128, 128
CONTEXT = PROMPT_LEN + OUTPUT_LEN // 2  # batch-1 decode steps are timed at this context
PROBE_PROMPT_LEN = 32
TOLERANCE = 0.02  # of the largest logit
STEP_RATIO_TARGET, ROOFLINE_TARGET = 0.6, 1.3


# --- one rank: the probe -------------------------------------------------------------------


def median_ms(fn, device, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of fn(); CUDA events on a GPU, the wall clock on a CPU.  Every rank
    of a group calls it alike, so the collectives inside `fn` pair up."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def decode_feeds(batch: int, context: int, block_size: int) -> list:
    from memstep.core.shapes import cdiv
    from memstep.events.plan import SeqPlan

    pages = cdiv(context + 1, block_size)
    table = lambda i: list(range(i * pages, (i + 1) * pages))  # noqa: E731
    return [(SeqPlan(f"b{i}", context, [5], table(i), True, 0, 0), [5]) for i in range(batch)]


def probe_prompt(vocab: int) -> list[int]:
    rng = random.Random(11)
    return [rng.randrange(3, vocab) for _ in range(PROBE_PROMPT_LEN)]


def copy_bandwidth(device) -> float:
    """Bytes read + written per second by a device-to-device copy (bench_gpu.py's measure)."""
    import torch

    n = (2 * 2**30 if device.type == "cuda" else 64 * 2**20) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    return 2 * n * 4 / (median_ms(lambda: dst.copy_(src), device, 10) / 1e3)


def probe(args: argparse.Namespace) -> dict:
    """Build one rank's worker through capture, measure, and (rank 0) write the figures."""
    import torch

    from memstep.core.config import EngineConfig
    from memstep.events.plan import SeqPlan
    from memstep.executors.process.assemble import build_worker

    cfg = EngineConfig.from_dict(json.loads(args.config))
    ranks = None
    if cfg.tensor_parallel_size > 1:
        from memstep.executors.model.rank_group import RankGroup

        assert cfg.distributed_init_method is not None
        ranks = RankGroup(args.rank, cfg.tensor_parallel_size, cfg.distributed_init_method)
    worker = build_worker(cfg, CONTEXT + PROBE_PROMPT_LEN + 64, ranks)
    replies = {phase: worker.enter_phase(phase, 0) for phase in ("profile", "warmup", "capture")}
    memory_plan = replies["profile"].memory_plan
    assert memory_plan is not None
    model, device, block = worker.model, worker.device, cfg.block_size
    prompt = probe_prompt(worker.model_cfg.vocab_size)
    with torch.inference_mode():
        seq = SeqPlan("probe", 0, prompt, list(range(4)), True, 0, len(prompt))
        hidden, last = worker.forward([(seq, prompt)])
        logits = model.logits(hidden[last]).float().cpu().numpy()
        feeds = decode_feeds(1, CONTEXT, block)
        step_ms = median_ms(lambda: model.logits(worker.forward(feeds)[0][:1]), device, 50)
        x = torch.randn(1, worker.model_cfg.hidden_size, dtype=worker.dtype, device=device)
        head = torch.randn(1, model.lm_head.shape[0], device=device)
        reduce_ms = gather_ms = 0.0
        if ranks is not None:
            reduce_ms = median_ms(lambda: ranks.all_reduce(x), device, 100)
            gather_ms = median_ms(lambda: ranks.all_gather_columns(head), device, 100)
    weights = sum(t.numel() * t.element_size() for t in worker.weights.values())
    embed = worker.weights["embed"]
    figures = {
        "rank": args.rank,
        "device": str(device),
        "step_ms_batch1": round(step_ms, 4),
        "allreduce_ms": round(reduce_ms, 4),
        "allreduces_per_step": 2 * worker.model_cfg.num_layers + 1,
        "logits_allgather_ms": round(gather_ms, 4),
        "weights_bytes": weights,
        "read_bytes": weights - embed.numel() * embed.element_size(),
        "copy_bandwidth": copy_bandwidth(device),
        "num_kv_blocks": memory_plan.num_kv_blocks,
        "kv_page_bytes": memory_plan.kv_page_bytes,
        "graph_sizes": replies["capture"].figures.graph_sizes,
    }
    out = Path(args.probe)
    if args.rank == 0:
        np.save(out.with_suffix(".logits.npy"), logits)
    out.with_name(f"{out.stem}.rank{args.rank}.json").write_text(json.dumps(figures))
    if ranks is not None:
        ranks.close()
    return figures


def sweep(args: argparse.Namespace) -> None:
    """One rank of the all-reduce sweep: [rows, hidden] activations of `--dtype` summed over the
    group (NCCL on CUDA, gloo on a CPU), for the sizes docs/tensor_parallel.md discusses."""
    import torch

    from memstep.executors.model.rank_group import RankGroup

    size, method = args.sweep_size, args.sweep_method
    ranks = RankGroup(args.rank, size, method)
    device = ranks.gpu() if args.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    rows = []
    for hidden in (4096, 8192):
        for n in (1, 64, 256):
            x = torch.randn(n, hidden, dtype=dtype, device=device)
            ms = median_ms(lambda x=x: ranks.all_reduce(x), device, 50, warmup=5)
            nbytes = x.numel() * x.element_size()
            rows.append({"rows": n, "hidden": hidden, "bytes": nbytes, "ms": round(ms, 4)})
    if args.rank == 0:
        Path(args.sweep_out).write_text(json.dumps({"device": str(device), "rows": rows}))
    ranks.close()


def run_sweep(args: argparse.Namespace, size: int) -> dict:
    from memstep.executors.process.local_ranks import loopback_init_method

    out = args.out / "allreduce_sweep.json"
    common = ["--sweep-size", str(size), "--sweep-method", loopback_init_method()]
    common += ["--sweep-out", str(out), "--device", args.device, "--dtype", args.dtype]
    procs = [
        subprocess.Popen([sys.executable, __file__, *common, "--rank", str(r)]) for r in range(size)
    ]
    if any(p.wait() for p in procs):
        raise RuntimeError("all-reduce sweep ranks failed")
    return json.loads(out.read_text())


# --- the orchestrator ----------------------------------------------------------------------


def engine_config(args: argparse.Namespace, model: str, tp: int, **more: Any):
    from memstep.core.config import EngineConfig

    return EngineConfig(
        model=model,
        dtype=args.dtype,
        device=args.device,
        seed=0,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
        tensor_parallel_size=tp,
        **more,
    )


def run_probe(cfg, out: Path, name: str) -> list[dict]:
    """Every rank of `cfg` as a probe process; each rank's figures, rank 0's first."""
    from memstep.executors.process.local_ranks import loopback_init_method

    if cfg.tensor_parallel_size > 1:
        cfg = cfg.replace(distributed_init_method=loopback_init_method())
    path = out / f"{name}.json"
    config = json.dumps(cfg.to_dict())
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--probe", str(path), "--rank", str(r), "--config", config]
        )
        for r in range(cfg.tensor_parallel_size)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"probe {name} ranks exited with {codes}")
    ranks = range(cfg.tensor_parallel_size)
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in ranks]


def compare(out: Path, one: list[dict], two: list[dict]) -> dict:
    a = np.load(out / "probe_8b_tp1.logits.npy")
    b = np.load(out / "probe_8b_tp2.logits.npy")
    diff = float(np.abs(a - b).max())
    scale = float(np.abs(a).max())
    ratio = two[0]["step_ms_batch1"] / one[0]["step_ms_batch1"]
    return {
        "logits_max_abs_diff": diff,
        "logits_max_abs": scale,
        "tolerance": TOLERANCE * scale,
        "logits_within_tolerance": diff <= TOLERANCE * scale,
        "same_argmax": bool((a.argmax(-1) == b.argmax(-1)).all()),
        "step_ms_tp1": one[0]["step_ms_batch1"],
        "step_ms_tp2": two[0]["step_ms_batch1"],
        "step_ratio": round(ratio, 3),
        "step_ratio_target": STEP_RATIO_TARGET,
        "step_ratio_met": ratio <= STEP_RATIO_TARGET,
    }


def roofline(ranks: list[dict]) -> dict:
    """Each rank's step against its weight-read roofline plus its measured collectives."""
    rows = []
    for r in ranks:
        weight_ms = r["read_bytes"] / r["copy_bandwidth"] * 1e3
        comm_ms = r["allreduce_ms"] * r["allreduces_per_step"] + r["logits_allgather_ms"]
        bound = weight_ms + comm_ms
        rows.append(
            {
                "rank": r["rank"],
                "step_ms": r["step_ms_batch1"],
                "weight_roofline_ms": round(weight_ms, 4),
                "collectives_ms": round(comm_ms, 4),
                "ratio": round(r["step_ms_batch1"] / bound, 3),
            }
        )
    return {
        "ranks": rows,
        "target": ROOFLINE_TARGET,
        "met": all(row["ratio"] <= ROOFLINE_TARGET for row in rows),
    }


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def throughput(cfg, sizes: list[int], prompt_len: int, output_len: int) -> dict:
    """Output tokens/s at each number of concurrent requests, through the process executor."""
    from memstep.core.engine import Engine
    from memstep.core.sampling_params import SamplingParams
    from memstep.executors.process.remote import ProcessExecutor

    engine = Engine(cfg, ProcessExecutor)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    result = {}
    try:
        for n in sizes:
            for prompt in random_prompts(n, prompt_len, engine.model_cfg.vocab_size, n):
                engine.add_request(prompt, params)
            start, produced = time.perf_counter(), 0
            while engine.has_work():
                produced += sum(len(out.new_token_ids) for out in engine.step())
            seconds = time.perf_counter() - start
            assert produced == n * output_len, (produced, n * output_len)
            result[str(n)] = {"tok_per_s": round(produced / seconds, 1), "seconds": seconds}
    finally:
        engine.shutdown()
    return result


class RankMemory:
    """Every StepResult's per-rank memory reports, kept as the engine receives them."""

    def __init__(self, executor):
        self.first: list | None = None
        self.last: list | None = None
        self.num_leaks = 0
        inner = executor.execute

        def execute(plan):
            result = inner(plan)
            self.first = self.first or result.rank_memory
            self.last = result.rank_memory
            self.num_leaks += len(result.leaks)
            return result

        executor.execute = execute


def memory_run(cfg, num_requests: int, max_concurrency: int) -> dict:
    from memstep.cli.traffic import rising_waves
    from memstep.core.engine import Engine
    from memstep.executors.process.remote import ProcessExecutor

    engine = Engine(cfg, ProcessExecutor)
    watch = RankMemory(engine.executor)
    try:
        start = time.perf_counter()
        steps = rising_waves(engine, num_requests, max_concurrency, seed=7)
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    assert watch.first and watch.last, "no step ran"
    ranks = []
    for rank, (a, b) in enumerate(zip(watch.first, watch.last, strict=True)):
        ranks.append(
            {
                "rank": rank,
                "reserved_bytes": [a.reserved_bytes, b.reserved_bytes],
                "live_bytes": [a.live_bytes, b.live_bytes],
                "segments": [a.num_segments, b.num_segments],
                "reserved_growth": b.reserved_bytes - a.reserved_bytes,
            }
        )
    flat = all(r["reserved_growth"] <= 0 for r in ranks)
    return {
        "requests": num_requests,
        "steps": steps,
        "seconds": round(seconds, 1),
        "leak_reports": watch.num_leaks,
        "ranks": ranks,
        "no_growth_on_any_rank": flat,
    }


def attempt(report: dict, name: str, fn) -> Any:
    """Run one section; a failure is recorded in the report instead of ending the run."""
    try:
        report[name] = fn()
    except Exception as exc:  # noqa: BLE001 - a benchmark keeps going past one broken section
        report.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
        print(f"section {name} failed: {exc!r}", flush=True)
    return report.get(name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench_tp_out"))
    p.add_argument("--model", default="random:llama-3.1-8b", help="the TP=2 vs TP=1 model")
    p.add_argument("--big-model", default="random:llama-3.1-70b", help="the TP=2-only model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--sizes", default="64,256", help="concurrent requests for tokens/s")
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    p.add_argument("--memory-requests", type=int, default=2000)
    p.add_argument("--skip", default="", help="sections to skip, comma-separated")
    p.add_argument("--probe", help=argparse.SUPPRESS)  # internal: run one rank's probe
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument(
        "--allreduce-sweep", type=int, default=0, help="only time all-reduces over N ranks"
    )
    p.add_argument("--sweep-size", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sweep-method", help=argparse.SUPPRESS)
    p.add_argument("--sweep-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        probe(args)
        return 0
    if args.sweep_size:
        sweep(args)
        return 0
    if args.allreduce_sweep:
        args.out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(run_sweep(args, args.allreduce_sweep), indent=1))
        return 0
    out, skip = args.out, set(args.skip.split(","))
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    sizes = [int(s) for s in args.sizes.split(",")]
    small, big = engine_config(args, args.model, 1), engine_config(args, args.big_model, 2)
    small2 = small.replace(tensor_parallel_size=2)
    one = attempt(report, "probe_8b_tp1", lambda: run_probe(small, out, "probe_8b_tp1"))
    two = attempt(report, "probe_8b_tp2", lambda: run_probe(small2, out, "probe_8b_tp2"))
    if one and two:
        attempt(report, "tp2_vs_tp1", lambda: compare(out, one, two))
    if "throughput" not in skip:
        attempt(report, "throughput_8b", lambda: _both(small, small2, sizes, args))
    if "sweep" not in skip:
        attempt(report, "allreduce_sweep", lambda: run_sweep(args, 2))
    if "big" not in skip:
        big_ranks = attempt(report, "probe_70b_tp2", lambda: run_probe(big, out, "probe_70b_tp2"))
        if big_ranks:
            attempt(report, "roofline_70b", lambda: roofline(big_ranks))
        concurrency = args.max_num_seqs
        attempt(
            report, "memory_70b_tp2", lambda: memory_run(big, args.memory_requests, concurrency)
        )
    (out / "bench_tp.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: v for k, v in report.items() if k != "args"}, indent=1, default=str))
    return 1 if "errors" in report else 0


def _both(one, two, sizes: list[int], args: argparse.Namespace) -> dict:
    return {
        "tp1": throughput(one, sizes, args.prompt_len, args.output_len),
        "tp2": throughput(two, sizes, args.prompt_len, args.output_len),
    }


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
