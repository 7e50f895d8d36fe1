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

On a shared machine the ratio drifts with other people's load, so each run also reports the CPU
seconds each process spent (core, executor, HTTP front, this client; from /proc), and per output
token: what the HTTP path itself costs, whatever the machine is doing.  Printed at the end: the
medians, their ratio, and the median of each repeat's own HTTP / ZMQ ratio.

    python benchmarks/bench_http_vs_zmq.py [--model smollm2] [--num-prompts 32]
        [--concurrency 16] [--output-len 64] [--repeats 3] [--dataset synthetic] [--num-threads N]
        [--api-server-count N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from common import cpu_seconds, server_pids

from memstep.cli.bench_serve import _samples, arrival_gaps, benchmark, compute_metrics
from memstep.cli.serve import ServerProcess
from memstep.core.config import EngineConfig


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dataset", default="synthetic")
    p.add_argument("--backends", default="zmq,openai", help="comma-separated, run alternately")
    p.add_argument("--num-threads", type=int, help="the executor's torch threads")
    p.add_argument("--api-server-count", type=int, default=1, help="HTTP front processes")
    return p.parse_args()


def main() -> None:
    args = parse()
    load = argparse.Namespace(
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        sample_seed=0,
        max_output_len=args.output_len,
        max_concurrency=args.concurrency,
        disable_tqdm=True,
        timeout=600.0,
        backend="zmq",
    )
    cfg = EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.concurrency)
    samples = _samples(load, cfg)
    gaps = arrival_gaps(len(samples), float("inf"), 1.0, 0)
    flags = ["--model", args.model, "--dtype", args.dtype]
    flags += ["--max-num-seqs", str(args.concurrency), "--no-record", "--no-enable-prefix-caching"]
    if args.num_threads:
        flags += ["--num-threads", str(args.num_threads)]
    flags += ["--api-server-count", str(args.api_server_count)]
    backends = args.backends.split(",")
    tps: dict[str, list[float]] = {b: [] for b in backends}
    with ServerProcess(flags, http=True) as server:
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
                m = compute_metrics(results, duration)
                tps[backend].append(m["output_throughput"])
                print(f"run {repeat} {backend:<12} {describe(m, used)}", flush=True)
    summarise(backends, tps)


def describe(m: dict[str, Any], used: dict[str, float]) -> str:
    cpu = " ".join(f"{name} {seconds:.2f}" for name, seconds in used.items())
    tokens = max(m["total_output_tokens"], 1)
    per_token = " ".join(f"{name} {1e6 * seconds / tokens:.0f}" for name, seconds in used.items())
    return (
        f"ok {m['completed']:>3} failed {m['failed']} "
        f"in/out tokens {m['total_input_tokens']}/{m['total_output_tokens']}  "
        f"output {m['output_throughput']:7.1f} tok/s  "
        f"TTFT median {m['median_ttft_ms']:7.1f} ms  ITL median {m['median_itl_ms']:6.1f} ms  "
        f"CPU s: {cpu}  CPU us/output token: {per_token}"
    )


def summarise(backends: list[str], tps: dict[str, list[float]]) -> None:
    medians = {b: statistics.median(v) for b, v in tps.items()}
    for backend, value in medians.items():
        print(f"median output tok/s {backend:<12} {value:7.1f}")
    if "zmq" not in medians:
        return
    for backend in backends:
        if backend != "zmq":
            pairs = [h / z for h, z in zip(tps[backend], tps["zmq"], strict=True)]
            print(
                f"{backend} / zmq: {medians[backend] / medians['zmq']:.3f} (medians), "
                f"{statistics.median(pairs):.3f} (median of the repeats' own ratios)"
            )


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"took {time.perf_counter() - started:.0f} s")
