"""Replicas behind one router (`serve --data-parallel-size`): a replica's core killed under load,
the same load without the kill, one engine beside them; and the throughput of replicas.

Each run is a `memstep serve` in its own process, loaded over ZMQ by `bench serve`'s load
(`cli/bench_serve.py`: the dataset's prompts at `--request-rate`, `--ignore-eos`, real reply
lengths).  In the `kill` run the first replica's core is SIGKILLed `--kill-at` seconds in; its
requests migrate to the survivor.  Reported per run: completed and failed requests, output
tokens/s, TTFT and TPOT, goodput with `--goodput`; for the kill run, the migrated requests and
their extra latency (the router's `RouteEnded.migration_pause_s`: the loss to the next token), and
the survivor's reserved and live memory from the router's stats (sampled every second): flat when
its reserved bytes never grow.

    python benchmarks/bench_replicas.py --model random:llama-3.1-8b --tokenizer T --device cuda \\
        --num-prompts 7200 --request-rate 60 --kill-at 60           # must-show 3, one H200
    python benchmarks/bench_replicas.py --two-gpus --goodput ttft:500 tpot:50 ...   # 2 GPUs vs 1
    python benchmarks/bench_replicas.py --cpu-threads               # must-show 4: SmolLM2, CPU
    python benchmarks/bench_replicas.py --quick                     # random:tiny on the CPU

`--cpu-threads`: SmolLM2, 2 replicas at one thread each against 1 engine at two threads, 16
requests in flight, total output tokens/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from memstep.api.client import Client
from memstep.cli.bench_serve import arrival_gaps, benchmark, compute_metrics, parse_goodput
from memstep.cli.datasets import Sample, load_dataset
from memstep.cli.serve import ServerProcess
from memstep.core.model_source import model_config, resolve
from memstep.core.tokenizer import load_tokenizer
from memstep.events.routing import RequestMigrated, RouteEnded
from memstep.router.replay import load_router_log


class MemorySampler(threading.Thread):
    """Every second, each replica's memory figures from the router's (or the core's) stats."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.address = address
        self.stopped = threading.Event()
        self.samples: list[tuple[float, str, dict[str, int]]] = []

    def run(self) -> None:
        """One sample at once, one a second, one when the load is over (a short load on a busy
        machine may last under a second)."""
        start = time.monotonic()
        with Client(self.address, timeout=30) as client:
            self._sample(client, start)
            while not self.stopped.wait(1.0):
                self._sample(client, start)
            self._sample(client, start)

    def _sample(self, client: Client, start: float) -> None:
        try:
            stats = client.stats()
        except (TimeoutError, ConnectionError):
            return
        now = time.monotonic() - start
        for replica, figures in _figures(stats).items():
            self.samples.append((now, replica, figures))

    def survivor(self, replica: str) -> dict[str, Any]:
        """Reserved and live bytes of `replica` over the run: first, max, growth."""
        rows = [f for _, r, f in self.samples if r == replica and "memory_reserved_bytes" in f]
        if not rows:
            return {}
        reserved = [f["memory_reserved_bytes"] for f in rows]
        live = [f["memory_live_bytes"] for f in rows]
        return {
            "samples": len(rows),
            "reserved_first": reserved[0],
            "reserved_max": max(reserved),
            "reserved_growth": max(reserved) - reserved[0],
            "live_first": live[0],
            "live_max": max(live),
        }


def _figures(stats: Any) -> dict[str, dict[str, int]]:
    if stats.replicas:
        return dict(stats.replicas)
    m = stats.memory
    if m is None:
        return {}
    return {"0": {"memory_reserved_bytes": m.reserved_bytes, "memory_live_bytes": m.live_bytes}}


def run_one(
    label: str,
    flags: list[str],
    samples: list[Sample],
    args: argparse.Namespace,
    kill_at: float | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One server, one load; the metrics, and for a kill run what the router's log says."""
    print(f"--- {label}: memstep serve {' '.join(flags)}", flush=True)
    with ServerProcess(flags, env=env) as server:
        server.wait_ready(timeout=900)
        sampler = MemorySampler(server.address)
        sampler.start()
        killer = None
        if kill_at is not None:
            victim = server.info["replicas"][0]["core_pid"]
            killer = threading.Timer(kill_at, os.kill, (victim, signal.SIGKILL))
            killer.start()
        gaps = arrival_gaps(len(samples), args.request_rate, 1.0, args.seed)
        load = argparse.Namespace(
            disable_tqdm=True, max_concurrency=args.max_concurrency, backend="zmq", timeout=600.0
        )
        results, duration = asyncio.run(benchmark(server.address, samples, gaps, True, load))
        sampler.stopped.set()
        sampler.join(timeout=35)
        if killer is not None:
            killer.cancel()
        out = compute_metrics(results, duration, parse_goodput(args.goodput))
        out["label"] = label
        out["errors"] = sorted({r.error for r in results if r.error})[:5]
        if server.info.get("router_log"):
            out |= _router_figures(Path(server.info["router_log"]))
        out["memory"] = {r: sampler.survivor(r) for r in sorted({s[1] for s in sampler.samples})}
        return out


def _router_figures(path: Path) -> dict[str, Any]:
    records = load_router_log(path).records
    ended = [r for r in records if isinstance(r, RouteEnded)]
    pauses = sorted(r.migration_pause_s for r in ended if r.num_migrations)
    figures: dict[str, Any] = {
        "migrations": sum(isinstance(r, RequestMigrated) for r in records),
        "migrated_finished": len(pauses),
    }
    if pauses:
        figures["pause_mean_s"] = statistics.fmean(pauses)
        figures["pause_p50_s"] = pauses[len(pauses) // 2]
        figures["pause_max_s"] = pauses[-1]
    return figures


def samples_of(args: argparse.Namespace) -> list[Sample]:
    source = resolve(args.model, 0, args.tokenizer)
    mc = model_config(source)
    tokenizer = load_tokenizer(source, mc.vocab_size, mc.eos_token_ids)
    samples = load_dataset(args.dataset, args.num_prompts, tokenizer, args.seed)
    if args.max_output_len:
        samples = [
            Sample(s.prompt, s.prompt_len, min(s.output_len, args.max_output_len)) for s in samples
        ]
    return samples


def plan(args: argparse.Namespace) -> list[tuple[str, list[str], float | None, dict | None]]:
    """(label, serve flags, kill time, environment) of each run."""
    base = ["--model", args.model, "--device", args.device, *shlex.split(args.serve_flags)]
    base += ["--tokenizer", args.tokenizer] if args.tokenizer else []
    dp2 = [*base, "--data-parallel-size", "2"]
    if args.cpu_threads:
        return [
            ("2 replicas x 1 thread", [*dp2, "--num-threads", "1"], None, None),
            ("1 engine x 2 threads", [*base, "--num-threads", "2"], None, None),
        ]
    if args.two_gpus:
        one, two = dict(os.environ, CUDA_VISIBLE_DEVICES="0"), dict(os.environ)
        two["CUDA_VISIBLE_DEVICES"] = "0,1"
        return [("1 engine, 1 GPU", base, None, one), ("2 replicas, 2 GPUs", dp2, None, two)]
    return [
        ("2 replicas, kill", dp2, args.kill_at, None),
        ("2 replicas", dp2, None, None),
        ("1 engine", base, None, None),
    ]


def table(runs: list[dict[str, Any]]) -> str:
    keys = [
        "completed",
        "failed",
        "output_throughput",
        "request_goodput",
        "median_ttft_ms",
        "median_tpot_ms",
        "migrations",
        "pause_mean_s",
        "pause_max_s",
    ]
    lines = ["run".ljust(24) + "".join(k[:18].rjust(19) for k in keys)]
    for r in runs:
        cells = [r.get(k, "") for k in keys]
        text = [f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells]
        lines.append(r["label"].ljust(24) + "".join(t.rjust(19) for t in text))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    samples = samples_of(args)
    chosen = plan(args)
    if args.runs:
        chosen = [chosen[int(i)] for i in args.runs.split(",")]
    runs = [run_one(label, flags, samples, args, kill, env) for label, flags, kill, env in chosen]
    print(table(runs))
    for r in runs:
        print(f"{r['label']}: memory {json.dumps(r['memory'])}; errors {r['errors']}")
    if args.cpu_threads and len(runs) == 2:
        first, second = runs[0]["output_throughput"], runs[1]["output_throughput"]
        print(f"output tok/s, 2 replicas x 1 thread / 1 engine x 2 threads: {first / second:.3f}")
    if args.two_gpus and args.goodput and len(runs) == 2:
        ratio = runs[1]["request_goodput"] / max(runs[0]["request_goodput"], 1e-9)
        print(f"goodput, 2 replicas on 2 GPUs / 1 engine on 1 GPU: {ratio:.3f} (goal >= 1.8)")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    killed = [r for r in runs if r["label"].endswith("kill")]
    return 1 if any(r["failed"] for r in killed) else 0


MODES = {  # what each mode changes of the defaults; a flag given on the command line wins
    "h200": {
        "model": "random:llama-3.1-8b",
        "device": "cuda",
        "dataset": "sharegpt",
        "num_prompts": 7200,
        "request_rate": 60.0,
        "kill_at": 60.0,
    },
    "quick": {
        "model": "random:tiny",
        "device": "cpu",
        "dataset": "synthetic",
        "num_prompts": 40,
        "request_rate": 20.0,
        "kill_at": 1.0,
        "max_output_len": 64,
    },
    "cpu_threads": {
        "model": "smollm2",
        "device": "cpu",
        "dataset": "synthetic",
        "num_prompts": 32,
        "request_rate": float("inf"),
        "max_concurrency": 16,
        "max_output_len": 64,
    },
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="(default: random:llama-3.1-8b)")
    p.add_argument("--tokenizer", help="a tokenizer.json or .gguf for a random: model")
    p.add_argument("--device", help="(default: cuda)")
    p.add_argument("--dataset", help="(default: sharegpt)")
    p.add_argument("--num-prompts", type=int, help="(default: 7200)")
    p.add_argument("--request-rate", type=float, help="(default: 60)")
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--max-output-len", type=int)
    p.add_argument("--kill-at", type=float, metavar="SECONDS", help="(default: 60)")
    p.add_argument("--goodput", nargs="*", metavar="KEY:MS", help="as `bench serve --goodput`")
    p.add_argument("--serve-flags", default="", help="more `memstep serve` flags, one string")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="every run's figures")
    p.add_argument("--runs", metavar="I,J", help="only these of the mode's runs, by index from 0")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="random:tiny on the CPU, seconds")
    mode.add_argument("--cpu-threads", action="store_true", help="must-show 4 (see above)")
    mode.add_argument("--two-gpus", action="store_true", help="2 replicas on 2 GPUs against 1")
    args = p.parse_args(argv)
    chosen = "quick" if args.quick else "cpu_threads" if args.cpu_threads else "h200"
    for key, value in MODES[chosen].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


if __name__ == "__main__":
    sys.exit(main())
