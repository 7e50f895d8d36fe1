"""Capacity under an SLO: the highest Poisson rate whose P99 TTFT <= 500 ms and mean TPOT <= 50 ms.

One `memstep serve` (with its HTTP front, prefix caching off so every run costs the same) serves
the same sample at rising rates, over each backend in turn (`zmq`, `openai`): the rate doubles
from `--rate-start` until a run misses the SLO (the last doubling stops at `--rate-max`, which is
tried), then `--bisect` halvings between the last rate that met it and the first that did not.
Each rate's arrivals last `--seconds` (the sample repeated): a shorter load is a burst, whose
queue never forms (docs/benchmarks.md).  Each run is `bench serve`'s load (`--ignore-eos`,
vLLM's ShareGPT sample by default) with vLLM's goodput counted; its CPU seconds by process
(core, executor, HTTP front, this client) are kept, so the front's cost is measured whatever
the machine does; the server's running batch and queue, read from its stats every 0.25 s
(`BatchWatch`), say whether `--max-num-seqs` or the device bound a miss.

Beside it, an ideal engine's capacity for the same workload, from the device's measured matmul
rate R and read bandwidth BW: every prompt's FLOPs at R; decode steps of the whole running batch
at TPOT, i.e. S = 1 / TPOT steps a second, each reading the weights W and the batch's KV at BW or
doing its FLOPs at R, whichever is longer.  With p and o a request's mean prompt and reply tokens,
F the FLOPs of a token and K the KV bytes of a reply token's mean context, a rate is served when
rate * p * F / R + max(S * W / BW + rate * o * K / BW, rate * o * F / R) <= 1 second a second
(attention FLOPs and the TTFT bound, a prompt's FLOPs at R, are left out: they do not bind).
The kernel floor is that engine with R the rate this device's GEMMs reach on the model's own
weight shapes (the best of 256-4,096 rows): what any engine built from them could serve.
Also printed: the pace batch (the most requests a decode step holds within TPOT); with
`--overload-prompts N`, N prompts at twice each capacity: served tok/s and TPOT against the run
at capacity, refusals that were not typed (`overloaded`; HTTP 503 + Retry-After), admitted lost.

    python benchmarks/bench_capacity.py --tokenizer tokenizer.json [--model random:llama-3.1-8b]
        [--num-prompts 1200] [--seconds 60] [--rate-start 16] [--bisect 3] [--backends zmq,openai]
        [--engine-flags "--max-waiting-requests 64"] [--overload-prompts 3600] [--out DIR]
    python benchmarks/bench_capacity.py --quick [--ideal-only]  # the CPU; the ideal alone
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import cpu_seconds, server_pids

from memstep.api.client import Client, ServerError
from memstep.cli.bench_serve import _samples, arrival_gaps, benchmark, compute_metrics
from memstep.cli.datasets import Sample, token_totals
from memstep.cli.serve import ServerProcess
from memstep.core.config import EngineConfig
from memstep.core.model_config import ModelConfig
from memstep.core.model_source import model_config, resolve

QUICK = {  # the CPU: a tiny model, a small sample, an SLO a 2-core machine can meet
    "model": "random:tiny",
    "dataset": "synthetic",
    "num_prompts": 12,
    "max_output_len": 8,
    "rate_start": 4.0,
    "rate_max": 16.0,
    "bisect": 1,
    "seconds": 0.0,
    "slo_ttft_p99": 2000.0,
    "slo_tpot_mean": 500.0,
    "engine_flags": "--num-threads 1 --max-num-seqs 8",
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the CPU check: " + json.dumps(QUICK))
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--tokenizer", help="tokenizer.json or .gguf (random: models' BPE lengths)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--dataset", default="sharegpt", help="as bench serve's (vLLM's sample)")
    p.add_argument("--num-prompts", type=int, default=1200)
    p.add_argument("--max-output-len", type=int, help="cap replies (default: real lengths)")
    p.add_argument("--rate-start", type=float, default=16.0, help="req/s of the first run")
    p.add_argument(
        "--rate-max", type=float, default=512.0, help="the last rate tried (doubling stops there)"
    )
    p.add_argument("--bisect", type=int, default=3, help="halvings after the doubling")
    p.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="each rate's arrivals last at least this long (the sample repeated as needed): a "
        "load that ends before its requests' lifetimes fill the batch is a burst, not a rate",
    )
    p.add_argument("--slo-ttft-p99", type=float, default=500.0, help="ms")
    p.add_argument("--slo-tpot-mean", type=float, default=50.0, help="ms")
    p.add_argument("--slo-ttft-mean", type=float, help="ms (default: not part of the SLO)")
    p.add_argument("--backends", default="zmq,openai")
    p.add_argument("--engine-flags", default="", help="more `memstep serve` flags, one string")
    p.add_argument(
        "--overload-prompts",
        type=int,
        default=0,
        help="then this many prompts at twice each backend's capacity (serve with "
        "--max-waiting-requests in --engine-flags): served rate, TPOT, refusals, losses",
    )
    p.add_argument("--out", type=Path, default=Path("bench_capacity_out"))
    p.add_argument(
        "--ideal-only",
        action="store_true",
        help="serve nothing: the workload, the ideal engine and the kernel floor on this device",
    )
    args = p.parse_args(argv)
    if args.quick:
        given = {a.lstrip("-").split("=")[0].replace("-", "_") for a in (argv or sys.argv[1:])}
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)
    return args


# --- one run, and the search ---------------------------------------------------------------


def meets(m: dict[str, Any], args: argparse.Namespace) -> bool:
    return (
        m["failed"] == 0
        and m["p99_ttft_ms"] <= args.slo_ttft_p99
        and m["mean_tpot_ms"] <= args.slo_tpot_mean
        and (args.slo_ttft_mean is None or m["mean_ttft_ms"] <= args.slo_ttft_mean)
    )


def one_run(
    url: str, backend: str, rate: float, samples: list[Sample], ctx: dict, label: str = ""
) -> dict:
    load = argparse.Namespace(backend=backend, timeout=600.0, disable_tqdm=True)
    gaps = arrival_gaps(len(samples), rate, 1.0, 0)
    before = cpu_seconds(ctx["pids"])
    with Client(ctx["address"], timeout=30) as client, BatchWatch(client.stats) as batch:
        results, duration = asyncio.run(benchmark(url, samples, gaps, True, load))
    cpu = {k: round(v - before[k], 2) for k, v in cpu_seconds(ctx["pids"]).items()}
    m = compute_metrics(results, duration, ctx["slo"])
    ctx["last"] = (results, samples)
    keep: tuple[str, ...] = ("completed", "failed", "request_throughput", "output_throughput")
    keep += ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "good_requests")
    run = {"rate": rate, "prompts": len(samples), **{k: m[k] for k in keep}, "cpu_s": cpu}
    run |= batch.figures()
    run["meets"] = meets(m, ctx["args"])
    out_tokens = max(1, sum(r.output_len for r in results if r.ok))
    run["front_cpu_us_a_token"] = round(cpu.get("http", 0.0) * 1e6 / out_tokens, 1)
    errors = [r.error for r in results if not r.ok]
    run["first_error"] = errors[0] if errors else None  # what a run that failed any met
    print(f"{label or backend:<7} {describe(run)}", flush=True)
    return run


class BatchWatch:
    """The server's running batch and queue during a run, read every `interval` s from its
    stats (a thread of its own): which of the two binds when a rate misses."""

    def __init__(self, stats: Callable[[], Any], interval: float = 0.25):
        self.stats, self.interval = stats, interval
        self.running: list[int] = []
        self.waiting: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> BatchWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while True:
            try:
                reply = self.stats()
            except (ServerError, TimeoutError, ConnectionError):
                return  # the server is gone: the run itself says so
            self.running.append(reply.num_running)
            self.waiting.append(reply.num_waiting)
            if self._stop.wait(self.interval):
                return

    def figures(self) -> dict[str, float]:
        busy = [n for n in self.running if n] or [0]
        return {
            "running_peak": max(self.running, default=0),
            "running_mean": round(statistics.mean(busy), 1),  # over the reads with any running
            "waiting_peak": max(self.waiting, default=0),
        }


def describe(run: dict) -> str:
    return (
        f"rate {run['rate']:7.2f} ({run['prompts']} prompts): "
        f"{'meets' if run['meets'] else 'MISSES'} the SLO; "
        f"served {run['request_throughput']:.2f} req/s, {run['output_throughput']:.0f} tok/s, "
        f"TTFT p99 {run['p99_ttft_ms']:.0f} ms, TPOT mean {run['mean_tpot_ms']:.1f} ms, "
        f"failed {run['failed']}, rows peak {run['running_peak']} (mean "
        f"{run['running_mean']:.0f}), waiting peak {run['waiting_peak']}, CPU s {run['cpu_s']}"
        + (f"; first error: {run['first_error'][:200]}" if run["first_error"] else "")
    )


def search(url: str, backend: str, samples: list[Sample], ctx: dict) -> dict:
    """Double the rate until a run misses the SLO, then bisect; the highest rate that met it."""
    args, runs = ctx["args"], []
    good, bad, rate = 0.0, math.inf, args.rate_start
    while rate <= args.rate_max:
        runs.append(one_run(url, backend, rate, sustained(samples, rate, args.seconds), ctx))
        if not runs[-1]["meets"]:
            bad = rate
            break
        good = rate
        rate = rate * 2 if rate * 2 <= args.rate_max or rate == args.rate_max else args.rate_max
    for _ in range(args.bisect if math.isfinite(bad) else 0):
        rate = (good + bad) / 2 if good else bad / 2
        runs.append(one_run(url, backend, rate, sustained(samples, rate, args.seconds), ctx))
        good, bad = (rate, bad) if runs[-1]["meets"] else (good, rate)
    best = max((r for r in runs if r["meets"]), key=lambda r: r["rate"], default=None)
    first_miss = bad if math.isfinite(bad) else None  # None: met up to --rate-max
    return {"capacity_req_s": good, "at_capacity": best, "first_miss": first_miss, "runs": runs}


def sustained(samples: list[Sample], rate: float, seconds: float) -> list[Sample]:
    """The sample, repeated until its Poisson arrivals at `rate` last `seconds` on average."""
    n = max(len(samples), math.ceil(rate * seconds))
    return [samples[i % len(samples)] for i in range(n)]


def overload(url: str, backend: str, found: dict, samples: list[Sample], ctx: dict) -> dict:
    """`--overload-prompts` at twice the capacity: what was served, how the admitted fared
    against the run at capacity, and whether every refusal was a typed one and nothing admitted
    was lost (each finished request got every token it asked for, as `--ignore-eos` asks)."""
    at, n = found["at_capacity"], ctx["args"].overload_prompts
    if not at or not n:
        return {}
    prompts = [samples[i % len(samples)] for i in range(n)]
    run = one_run(url, backend, 2 * at["rate"], prompts, ctx, f"{backend} 2x")
    results, asked = ctx["last"]
    refused = [r.error for r in results if not r.ok]
    typed = [e for e in refused if is_typed_refusal(e)]
    lost = sum(
        1 for r, s in zip(results, asked, strict=True) if r.ok and r.output_len != s.output_len
    )
    verdict = {
        "served_of_capacity": round(run["output_throughput"] / at["output_throughput"], 3),
        "tpot_of_capacity": round(run["mean_tpot_ms"] / at["mean_tpot_ms"], 3),
        "refused": len(refused),
        "untyped_refusals": [e for e in refused if e not in typed][:5],
        "admitted_lost": lost,
    }
    print(f"{backend} 2x: {verdict}", flush=True)
    return run | verdict


def is_typed_refusal(error: str) -> bool:
    """ZMQ: the `overloaded` ErrorReply; HTTP: a 503 with Retry-After that says overloaded."""
    return error.startswith("overloaded:") or (
        error.startswith("HTTP 503 (Retry-After") and "overloaded" in error
    )


# --- the ideal engine ----------------------------------------------------------------------


def device_rates(device: str) -> dict[str, float]:
    """The matmul rate (FLOP/s) and read bandwidth (bytes/s) of the device that serves."""
    import torch

    if device == "cuda":
        from bench_decode_floor import read_rate
        from bench_gpu import matmul_rate

        return {"matmul_flops": matmul_rate(), "read_bytes_s": read_rate()}
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    data = torch.randn(32 * 2**20)  # 128 MiB of float32: beyond the caches
    mm, rd = cpu_seconds_of(lambda: a @ b), cpu_seconds_of(data.sum)
    return {"matmul_flops": 2 * n**3 / mm, "read_bytes_s": data.numel() * 4 / rd}


def cpu_seconds_of(fn: Any, iters: int = 5) -> float:
    """The fastest of `iters` timed calls after one warm-up: the CPU's rate, less its noise."""
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def workload(samples: list[Sample]) -> dict[str, float]:
    """Mean prompt and reply tokens a request, and the mean context a reply token attends to."""
    num_in, num_out = token_totals(samples)
    contexts = sum(
        s.output_len * s.prompt_len + s.output_len * (s.output_len - 1) / 2 for s in samples
    )
    n = max(1, len(samples))
    return {"prompt": num_in / n, "output": num_out / n, "context": contexts / max(1, num_out)}


def ideal_capacity(
    mc: ModelConfig, dtype_bytes: int, rates: dict[str, float], load: dict, tpot_s: float
) -> dict[str, float]:
    """The ideal engine's highest rate under the SLO (module docstring) and its pace batch."""
    attn = mc.hidden_size * mc.head_dim * (2 * mc.num_heads + 2 * mc.num_kv_heads)
    mlp = 3 * mc.hidden_size * mc.intermediate_size
    matmul_params = mc.num_layers * (attn + mlp) + mc.vocab_size * mc.hidden_size  # + the head
    flops, weights = 2 * matmul_params, matmul_params * dtype_bytes
    kv_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * dtype_bytes
    r, bw, steps = rates["matmul_flops"], rates["read_bytes_s"], 1.0 / tpot_s
    prefill = load["prompt"] * flops / r  # device seconds a request
    memory = (1 - steps * weights / bw) / (
        prefill + load["output"] * load["context"] * kv_token / bw
    )
    compute = 1 / (prefill + load["output"] * flops / r)
    # the most rows one decode step holds within TPOT: reads and FLOPs each within it
    pace = min((tpot_s * bw - weights) / (load["context"] * kv_token), tpot_s * r / flops)
    return {
        "capacity_req_s": round(max(0.0, min(memory, compute)), 2),
        "bound": "reads" if memory < compute else "matmuls",
        "pace_batch": max(0, int(pace)),
        "weights_gb": round(weights / 1e9, 3),
        "kv_bytes_a_token": kv_token,
    }


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cfg = EngineConfig(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype)
    load = argparse.Namespace(dataset=args.dataset, num_prompts=args.num_prompts, sample_seed=0)
    load.max_output_len = args.max_output_len
    samples = _samples(load, cfg)
    flags = ["--model", args.model, "--dtype", args.dtype, "--no-enable-prefix-caching"]
    flags += (["--tokenizer", args.tokenizer] if args.tokenizer else []) + args.engine_flags.split()
    slo = {"ttft": args.slo_ttft_p99, "tpot": args.slo_tpot_mean}
    report: dict[str, Any] = {"slo_ms": {"p99_ttft": slo["ttft"], "mean_tpot": slo["tpot"]}}
    if args.slo_ttft_mean is not None:
        report["slo_ms"]["mean_ttft"] = args.slo_ttft_mean
    report["workload"] = workload(samples) | {"num_prompts": len(samples), "dataset": args.dataset}
    if args.ideal_only:
        report["ideal"] = ideal_of(args, cfg, report["workload"])
        print(summary(report, []))
        return 0
    with ServerProcess([*flags, "--no-record"], http=True) as server:
        server.wait_ready(timeout=1800)
        ctx = {"args": args, "slo": slo, "address": server.address}
        ctx["pids"] = server_pids(server.info)
        urls = {"zmq": server.address, "openai": server.http_url, "openai-chat": server.http_url}
        one_run(server.address, "zmq", args.rate_start, samples[:4], ctx, "warm-up")
        for backend in args.backends.split(","):
            report[backend] = search(urls[backend], backend, samples, ctx)
            report[backend]["overload"] = overload(
                urls[backend], backend, report[backend], samples, ctx
            )
    report["ideal"] = ideal_of(args, cfg, report["workload"])
    print(summary(report, args.backends.split(",")))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_capacity.json").write_text(json.dumps(report, indent=1))
    return 0


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def ideal_of(args: argparse.Namespace, cfg: EngineConfig, load: dict) -> dict:
    """The ideal engine on the device the server ran on (measured now the server is gone), and
    the kernel floor: the same engine with every matmul at the rate the device's own GEMMs reach
    on the model's weight shapes (`model_matmul_rate`), what any engine built from them could."""
    import torch

    mc = model_config(resolve(cfg.model, cfg.random_weights_seed, cfg.tokenizer))
    device = (
        "cuda" if torch.cuda.is_available() and "--device cpu" not in args.engine_flags else "cpu"
    )
    rates = device_rates(device)
    dtype_bytes = DTYPE_BYTES.get(args.dtype, 2 if device == "cuda" else 4)  # auto: bf16 / fp32
    tpot_s = args.slo_tpot_mean / 1e3
    ideal = ideal_capacity(mc, dtype_bytes, rates, load, tpot_s)
    shaped = model_matmul_rate(mc, device, dtype_bytes)
    floor = ideal_capacity(mc, dtype_bytes, rates | {"matmul_flops": shaped}, load, tpot_s)
    return ideal | {
        "device": device,
        "matmul_tflops": round(rates["matmul_flops"] / 1e12, 3),
        "read_tb_s": round(rates["read_bytes_s"] / 1e12, 3),
        "floor": floor | {"matmul_flops": shaped, "matmul_tflops": round(shaped / 1e12, 3)},
    }


FLOOR_TOKENS = (256, 1024, 4096)  # a step's rows: the floor takes the best rate of these


def model_matmul_rate(mc: ModelConfig, device: str, dtype_bytes: int) -> float:
    """FLOP/s of one layer's matmuls and the head (memstep's fused shapes: qkv, o, gate+up,
    down, lm_head) on `device`, the best over FLOOR_TOKENS rows: every token's FLOPs at the
    rate of the most efficient step size, so no engine using these GEMMs does better."""
    import torch

    dtype = {2: torch.bfloat16, 4: torch.float32}[dtype_bytes] if device == "cuda" else None
    h, hd = mc.hidden_size, mc.head_dim
    shapes = [
        (h, hd * (mc.num_heads + 2 * mc.num_kv_heads)),
        (mc.num_heads * hd, h),
        (h, 2 * mc.intermediate_size),
        (mc.intermediate_size, h),
    ]
    weights = [torch.randn(k, n, device=device, dtype=dtype) for k, n in shapes]
    head = torch.randn(h, mc.vocab_size, device=device, dtype=dtype)
    best = 0.0
    for m in FLOOR_TOKENS:
        pairs = [(torch.randn(m, w.shape[0], device=device, dtype=dtype), w) for w in weights]
        pairs.append((torch.randn(m, h, device=device, dtype=dtype), head))
        times = [kernel_seconds(functools.partial(torch.matmul, x, w), device) for x, w in pairs]
        seconds = mc.num_layers * sum(times[:-1]) + times[-1]
        flops = 2 * m * (mc.num_layers * sum(k * n for k, n in shapes) + h * mc.vocab_size)
        best = max(best, flops / seconds)
    return best


def kernel_seconds(fn: Callable[[], Any], device: str) -> float:
    if device == "cuda":
        from common import median_ms

        return median_ms(fn, 20, warmup=3) / 1e3
    return cpu_seconds_of(fn)


def summary(report: dict, backends: list[str]) -> str:
    ideal, w = report["ideal"], report["workload"]
    lines = [
        f"workload: {w['num_prompts']} prompts of {w['dataset']}, mean {w['prompt']:.0f} prompt / "
        f"{w['output']:.0f} reply tokens; SLO p99 TTFT <= {report['slo_ms']['p99_ttft']:g} ms, "
        f"mean TPOT <= {report['slo_ms']['mean_tpot']:g} ms"
        + (
            f", mean TTFT <= {report['slo_ms']['mean_ttft']:g} ms"
            if "mean_ttft" in report["slo_ms"]
            else ""
        ),
        f"ideal engine on {ideal['device']} (matmul {ideal['matmul_tflops']} TFLOP/s, read "
        f"{ideal['read_tb_s']} TB/s): {ideal['capacity_req_s']} req/s ({ideal['bound']} bound), "
        f"pace batch {ideal['pace_batch']}",
        f"kernel floor (the model's matmuls at {ideal['floor']['matmul_tflops']} TFLOP/s, this "
        f"device's GEMMs on its weight shapes): {ideal['floor']['capacity_req_s']} req/s "
        f"({ideal['floor']['bound']} bound)",
    ]
    for backend in backends:
        got, best = report[backend], report[backend]["at_capacity"] or {}
        share = got["capacity_req_s"] / ideal["capacity_req_s"] if ideal["capacity_req_s"] else 0
        floor = ideal["floor"]["capacity_req_s"]
        lines.append(
            f"{backend}: capacity {got['capacity_req_s']:.2f} req/s ({share:.2f} of the ideal, "
            f"{got['capacity_req_s'] / floor if floor else 0:.2f} of the kernel floor; "
            f"first miss {got['first_miss']}); there TTFT p99 {best.get('p99_ttft_ms', 0):.0f} ms, "
            f"TPOT mean {best.get('mean_tpot_ms', 0):.1f} ms, front CPU "
            f"{best.get('front_cpu_us_a_token', 0)} us a token"
        )
        over = got.get("overload") or {}
        if over:
            lines.append(
                f"{backend} at 2x ({over['rate']:.2f} req/s): served "
                f"{over['served_of_capacity']:.2f} of capacity's tok/s, TPOT "
                f"{over['tpot_of_capacity']:.2f}x, refused "
                f"{over['refused']} (untyped {len(over['untyped_refusals'])}), admitted lost "
                f"{over['admitted_lost']}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"took {time.perf_counter() - started:.0f} s")
    raise SystemExit(code)
