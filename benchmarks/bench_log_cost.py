"""What info-level logs cost: lines and bytes per request, and throughput against warning level.

`memstep serve` (SmolLM2 on the CPU, JSON logs) serves the seed workload (vLLM's ShareGPT
sampling, `cli/datasets.py`; replies cut at `--max-tokens`, EOS ignored, so every run makes
the same tokens) at `--streams` concurrent requests, once at `--log-level info` and once at
`warning`, alternating `--repeats` times so that drift in the machine's load hits both alike.
Each run starts a fresh server; its time counts from the first request sent to the last answer.
Reported: the info runs' log lines and bytes per request (the lines written while requests were
served, start-up lines left out, by event), the median output tokens/s of each level and their
ratio.  Also the cost of one line, timed in this process (structlog's JSON renderer into a
null stream): lines per request times that, against the time a request takes at this
concurrency, is the overhead without the machine's noise.

    python benchmarks/bench_log_cost.py [--requests 64] [--streams 16] [--max-tokens 64]
        [--repeats 3] [--model smollm2] [--num-threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import time
from collections import Counter

import structlog

from memstep.api.client import AsyncClient
from memstep.cli.datasets import sample_sharegpt
from memstep.cli.serve import ServerProcess
from memstep.core.logging import setup_logging
from memstep.core.model_source import model_config, resolve
from memstep.core.tokenizer import load_tokenizer


def prompts(model: str, n: int) -> list[str]:
    source = resolve(model)
    mc = model_config(source)
    tokenizer = load_tokenizer(source, mc.vocab_size, mc.eos_token_ids)
    return [s.prompt for s in sample_sharegpt(n, tokenizer)]


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


def serve_once(args: argparse.Namespace, texts: list[str], level: str) -> tuple:
    """One fresh server at `level`: (tokens/s, the JSON lines written while serving)."""
    flags = ["--model", args.model, "--log-format", "json"]
    flags += ["--num-threads", str(args.num_threads)] if args.num_threads else []
    with ServerProcess(flags, log_level=level) as server:
        server.wait_ready(600)
        skip = len(server.log_path.read_bytes())
        seconds, tokens = asyncio.run(drive(server.address, texts, args.streams, args.max_tokens))
        server.stop()
        served = server.log_path.read_bytes()[skip:].decode(errors="replace").splitlines()
    lines = [line for line in served if line.startswith("{")]
    return tokens / seconds, lines


def line_cost_s(samples: int = 20000) -> float:
    """Seconds to render and write one typical request line at info level."""
    setup_logging("json", "info")
    sink = io.StringIO()
    structlog.configure(logger_factory=lambda *_: structlog.PrintLogger(sink))
    log = structlog.get_logger("bench")
    start = time.perf_counter()
    for i in range(samples):
        log.info("request admitted", step=i, request_id="zmq-12", engine_id="req-12",
                 prefix_hit_tokens=32, kind="no_spec")  # fmt: skip
    return (time.perf_counter() - start) / samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args()
    texts = prompts(args.model, args.requests)
    rates: dict[str, list[float]] = {"info": [], "warning": []}
    for _ in range(args.repeats):
        for level in ("info", "warning"):
            rate, lines = serve_once(args, texts, level)
            rates[level].append(rate)
            if level == "info":
                info_lines = lines
    report(args, rates, info_lines)


def report(args: argparse.Namespace, rates: dict, lines: list[str]) -> None:
    n = args.requests
    events = Counter(json.loads(line)["event"] for line in lines)
    num_bytes = sum(len(line) + 1 for line in lines)
    print(f"{args.model}, CPU, {n} ShareGPT prompts, {args.streams} streams, ", end="")
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
