"""The HTTP front's cost: the same load over ZMQ and over OpenAI HTTP, on one server.

One `memstep serve` (with its HTTP front) serves the same greedy requests again and again, the
runs alternating between `bench serve`'s backends (zmq, then openai, ...) so that drift in the
machine's load hits both alike.  Reported: each run's output tok/s, TTFT and ITL, and the ratio
of the medians of output tok/s (HTTP / ZMQ).

Every run must cost the engine the same: the server runs without prefix caching (otherwise a run
would reuse the prompts' KV that the run before it left, and whichever backend follows a run of
the same prompts would look faster), and one discarded run warms the server up first.  `openai`
sends the prompt as ZMQ does; `openai-chat` wraps it in the chat template (longer prompts), so
its figures are not a like-for-like comparison with ZMQ's.

With `--request-rate R` requests arrive as a Poisson process of R a second (vLLM's
`benchmark_serving` load, the same arrival times in every run) instead of a closed loop of
`--concurrency`: the load under which the issue's TTFT is measured.  Each run then also reports
TTFT's and ITL's mean and p99, and how many tokens came per timed arrival (1.0 when every token
arrives on its own; more when a stream's tokens are bunched, or some are not sent at all); the
end gives the HTTP / ZMQ ratios of TTFT's mean and p99 and of TPOT's mean, median of the repeats.

On a shared machine the ratio drifts with other people's load, so each run also reports the CPU
seconds each process spent (core, executor, HTTP front, this client; from /proc), and per output
token: what the HTTP path itself costs, whatever the machine is doing.  Printed at the end: the
medians, their ratio, and the median of each repeat's own HTTP / ZMQ ratio.

    python benchmarks/bench_http_vs_zmq.py [--model smollm2] [--num-prompts 32]
        [--concurrency 16] [--output-len 64] [--repeats 3] [--dataset synthetic] [--num-threads N]
        [--api-server-count N] [--request-rate R --max-num-seqs N --max-num-batched-tokens N
        --tokenizer tokenizer.json --device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from typing import Any

from common import cpu_seconds, server_pids

from memstep.cli.bench_serve import (
    RequestResult,
    _samples,
    arrival_gaps,
    benchmark,
    compute_metrics,
)
from memstep.cli.serve import ServerProcess
from memstep.core.config import EngineConfig

RATIOS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms")  # HTTP / ZMQ, reported


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokenizer", help="a tokenizer.json used instead of the model's")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", help="the server's device (default: its own choice)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16, help="closed loop (no --request-rate)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson, requests/s")
    p.add_argument("--max-num-seqs", type=int, help="default: --concurrency")
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-model-len", type=int, help="and samples longer than this are dropped")
    p.add_argument("--output-len", type=int, default=64, help="output cap (0: each sample's own)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dataset", default="synthetic")
    p.add_argument("--backends", default="zmq,openai", help="comma-separated, run alternately")
    p.add_argument("--num-threads", type=int, help="the executor's torch threads")
    p.add_argument("--api-server-count", type=int, default=1, help="HTTP front processes")
    return p.parse_args()


def server_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--model", args.model, "--dtype", args.dtype]
    flags += ["--max-num-seqs", str(args.max_num_seqs or args.concurrency)]
    flags += ["--no-record", "--no-enable-prefix-caching"]
    for name in ("tokenizer", "device", "num_threads", "max_num_batched_tokens", "max_model_len"):
        if getattr(args, name):
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return flags + ["--api-server-count", str(args.api_server_count)]


def main() -> None:
    args = parse()
    closed = math.isinf(args.request_rate)
    load = argparse.Namespace(
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        sample_seed=0,
        max_output_len=args.output_len,
        max_concurrency=args.concurrency if closed else None,
        disable_tqdm=True,
        timeout=600.0,
        backend="zmq",
    )
    cfg = EngineConfig(model=args.model, dtype=args.dtype, tokenizer=args.tokenizer)
    samples = _samples(load, cfg)
    if args.max_model_len:
        samples = [s for s in samples if s.prompt_len + s.output_len <= args.max_model_len]
    gaps = arrival_gaps(len(samples), args.request_rate, 1.0, 0)
    backends = args.backends.split(",")
    runs: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
    with ServerProcess(server_flags(args), http=True) as server:
        server.wait_ready(timeout=600)
        urls = {"zmq": server.address, "openai": server.http_url, "openai-chat": server.http_url}
        pids = server_pids(server.info)
        asyncio.run(benchmark(server.address, samples, gaps, True, load))  # warm-up, not counted
        for repeat in range(args.repeats):
            for backend in backends:
                load.backend = backend
                before = cpu_seconds(pids)
                results, duration = asyncio.run(benchmark(urls[backend], samples, gaps, True, load))
                used = {k: v - before[k] for k, v in cpu_seconds(pids).items()}
                m = compute_metrics(results, duration) | {"per_arrival": per_arrival(results)}
                runs[backend].append(m)
                print(f"run {repeat} {backend:<12} {describe(m, used)}", flush=True)
    summarise(backends, runs)


def per_arrival(results: list[RequestResult]) -> float:
    """Output tokens per timed arrival (the first token and each ITL gap are one each)."""
    done = [r for r in results if r.ok]
    arrivals = sum(len(r.itl) + 1 for r in done if r.ttft > 0)
    return sum(r.output_len for r in done) / max(arrivals, 1)


def describe(m: dict[str, Any], used: dict[str, float]) -> str:
    cpu = " ".join(f"{name} {seconds:.2f}" for name, seconds in used.items())
    tokens = max(m["total_output_tokens"], 1)
    per_token = " ".join(f"{name} {1e6 * seconds / tokens:.0f}" for name, seconds in used.items())
    return (
        f"ok {m['completed']:>3} failed {m['failed']} "
        f"in/out tokens {m['total_input_tokens']}/{m['total_output_tokens']}  "
        f"output {m['output_throughput']:7.1f} tok/s  "
        f"TTFT mean/median/p99 {m['mean_ttft_ms']:.1f}/{m['median_ttft_ms']:.1f}/"
        f"{m['p99_ttft_ms']:.1f} ms  TPOT mean {m['mean_tpot_ms']:.1f} ms  "
        f"ITL mean/median/p99 {m['mean_itl_ms']:.1f}/{m['median_itl_ms']:.1f}/"
        f"{m['p99_itl_ms']:.1f} ms  tokens per arrival {m['per_arrival']:.2f}  "
        f"CPU s: {cpu}  CPU us/output token: {per_token}"
    )


def summarise(backends: list[str], runs: dict[str, list[dict[str, Any]]]) -> None:
    for backend, ms in runs.items():
        value = statistics.median(m["output_throughput"] for m in ms)
        print(f"median output tok/s {backend:<12} {value:7.1f}")
    if "zmq" not in runs:
        return
    for backend in backends:
        if backend == "zmq":
            continue
        pairs = list(zip(runs[backend], runs["zmq"], strict=True))
        ratios = [
            f"{key} {statistics.median(h[key] / max(z[key], 1e-9) for h, z in pairs):.3f}"
            for key in ("output_throughput", *RATIOS)
        ]
        print(f"{backend} / zmq (median of the repeats' own ratios): " + "  ".join(ratios))


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"took {time.perf_counter() - started:.0f} s")
