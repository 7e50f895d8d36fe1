"""The HTTP front's cost: the same load over ZMQ and over OpenAI HTTP, on one server.

One `memstep serve` (with its HTTP front) serves the same greedy requests again and again, the
runs alternating between `bench serve`'s backends (zmq, then openai, ...) so that drift in the
machine's load hits both alike.  Reported: each run's output tok/s, TTFT and ITL, and the ratio
of the medians of output tok/s (HTTP / ZMQ).

    python benchmarks/bench_http_vs_zmq.py [--model smollm2] [--num-prompts 32]
        [--concurrency 16] [--output-len 64] [--repeats 3] [--dataset synthetic] [--num-threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from memstep.cli.bench_serve import _samples, arrival_gaps, benchmark, compute_metrics
from memstep.cli.serve import ServerProcess
from memstep.core.config import EngineConfig


def main() -> None:
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
    args = p.parse_args()
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
    flags += ["--max-num-seqs", str(args.concurrency), "--no-record"]
    if args.num_threads:
        flags += ["--num-threads", str(args.num_threads)]
    backends = args.backends.split(",")
    tps: dict[str, list[float]] = {b: [] for b in backends}
    with ServerProcess(flags, http=True) as server:
        server.wait_ready(timeout=600)
        urls = {"zmq": server.address, "openai": server.http_url, "openai-chat": server.http_url}
        for repeat in range(args.repeats):
            for backend in backends:
                load.backend = backend
                results, duration = asyncio.run(benchmark(urls[backend], samples, gaps, True, load))
                m = compute_metrics(results, duration)
                tps[backend].append(m["output_throughput"])
                print(
                    f"run {repeat} {backend:<12} ok {m['completed']:>3} failed {m['failed']} "
                    f"output {m['output_throughput']:7.1f} tok/s  "
                    f"TTFT median {m['median_ttft_ms']:7.1f} ms  "
                    f"ITL median {m['median_itl_ms']:6.1f} ms",
                    flush=True,
                )
    medians = {b: statistics.median(v) for b, v in tps.items()}
    for backend, value in medians.items():
        print(f"median output tok/s {backend:<12} {value:7.1f}")
    if "zmq" in medians:
        for backend in backends:
            if backend != "zmq":
                print(f"{backend} / zmq: {medians[backend] / medians['zmq']:.3f}")


if __name__ == "__main__":
    main()
