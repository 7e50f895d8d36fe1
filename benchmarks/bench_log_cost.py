"""What info-level logs cost: lines and bytes per request, and throughput against warning level.

One engine and its API server (`serving/core_process.py`, turned by a thread of this process, as
`memstep serve` turns it) serve the seed workload (vLLM's ShareGPT sampling, `cli/datasets.py`;
replies cut at `--max-tokens`, EOS ignored, so every run makes the same tokens) at `--streams`
concurrent ZMQ requests.  Runs alternate between `--log-level info` and `warning` (JSON lines into a
file, as a deployment writes them), in both orders, `--repeats` times each, so that drift in the
machine's load hits both alike; the same process and the same warm engine serve both. Reported: the
info runs' lines and bytes per request, by event; the median output tokens/s of each level and their
ratio.  Also the cost of one line, timed here (structlog's JSON renderer into a null stream): the
lines of a request times that, against the engine's time per request, is the overhead without the
machine's noise.

    python benchmarks/bench_log_cost.py [--requests 32] [--streams 16] [--max-tokens 32]
        [--repeats 4] [--model smollm2] [--num-threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import structlog

from memstep.api.client import AsyncClient
from memstep.cli.datasets import sample_sharegpt
from memstep.core.config import EngineConfig
from memstep.core.logging import setup_logging
from memstep.executors.process.inprocess import local_engine
from memstep.serving.core_config import ServerConfig
from memstep.serving.core_process import Server


async def drive(address: str, texts: list[str], streams: int, max_tokens: int) -> tuple:
    """Every prompt, `streams` at a time; (seconds, output tokens)."""
    gate = asyncio.Semaphore(streams)
    client = AsyncClient(address, timeout=600)

    async def one(i: int, text: str) -> int:
        async with gate:
            done = await client.generate(text, max_tokens=max_tokens, ignore_eos=True, seed=i)
            return len(done.token_ids)

    try:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))
        return time.perf_counter() - start, sum(tokens)
    finally:
        await client.close()


def timed_run(
    server: Server, args: argparse.Namespace, texts: list[str], level: str, log: Path
) -> tuple[float, list[str]]:
    """One run at `level`, its lines into `log`: (tokens/s, the JSON lines it wrote)."""
    with log.open("w") as sink, contextlib.redirect_stderr(sink):
        setup_logging("json", level)
        seconds, tokens = asyncio.run(drive(server.endpoint, texts, args.streams, args.max_tokens))
        setup_logging("json", "warning")
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    return tokens / seconds, lines


def line_cost_s(samples: int = 20000) -> float:
    """Seconds to render and write one typical request line at info level."""
    setup_logging("json", "info")
    sink = io.StringIO()
    structlog.configure(logger_factory=lambda *_: structlog.WriteLogger(sink))
    log = structlog.get_logger("bench")
    start = time.perf_counter()
    for i in range(samples):
        log.info(
            "request admitted",
            step=i,
            request_id="zmq-12",
            engine_id="req-12",
            prefix_hit_tokens=32,
            kind="no_spec",
        )
    return (time.perf_counter() - start) / samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args()
    setup_logging("json", "warning")
    engine = local_engine(EngineConfig(model=args.model, num_threads=args.num_threads))
    texts = [s.prompt for s in sample_sharegpt(args.requests, engine.tokenizer)]
    server = Server(engine, ServerConfig(port=0, stats_interval_s=0))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    rates: dict[str, list[float]] = {"info": [], "warning": []}
    info_lines: list[str] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            timed_run(server, args, texts, "warning", Path(tmp) / "warm-up.log")
            for i in range(args.repeats):
                for level in ("info", "warning") if i % 2 == 0 else ("warning", "info"):
                    rate, lines = timed_run(server, args, texts, level, Path(tmp) / f"{i}.log")
                    rates[level].append(rate)
                    info_lines = lines if level == "info" else info_lines
                    print(f"run {i} {level}: {rate:.1f} tokens/s", file=sys.stderr)
    finally:
        server.stop()
        thread.join()
        server.close()
        engine.shutdown()
    report(args, rates, info_lines)


def report(args: argparse.Namespace, rates: dict, lines: list[str]) -> None:
    n = args.requests
    events = Counter(json.loads(line)["event"] for line in lines)
    num_bytes = sum(len(line) + 1 for line in lines)
    print(f"{args.model}, CPU, one server in-process, {n} ShareGPT prompts, ", end="")
    print(f"{args.streams} streams, ", end="")
    print(f"{args.max_tokens} tokens each, {args.repeats} runs a level, alternating")
    print(f"info level: {len(lines) / n:.2f} lines and {num_bytes / n:.0f} bytes per request")
    for event, count in events.most_common():
        print(f"  {event:<22} {count / n:6.2f} per request")
    info, warning = statistics.median(rates["info"]), statistics.median(rates["warning"])
    print(
        f"tokens/s: info {info:.1f} (runs {[round(r, 1) for r in rates['info']]}), warning ", end=""
    )
    print(f"{warning:.1f} (runs {[round(r, 1) for r in rates['warning']]})")
    print(f"throughput ratio info / warning: {info / warning:.4f}")
    cost = line_cost_s()
    engine_s = args.max_tokens / warning  # the engine's time per request, in steady state
    ms = len(lines) / n * cost * 1e3
    print(f"one line: {cost * 1e6:.1f} us; the lines of a request: {ms:.3f} ms, ", end="")
    print(f"{100 * ms / 1e3 / engine_s:.3f}% of the engine's {engine_s * 1e3:.1f} ms a request")


if __name__ == "__main__":
    main()
