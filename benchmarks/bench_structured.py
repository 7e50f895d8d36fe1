"""Structured outputs at speed: output tok/s of a mix where half the requests carry a JSON
schema, against the same mix without schemas, and what the grammars cost to compile.

Runs in one process (an in-process executor): `--concurrency` requests at once, each `--tokens`
new tokens (ignore_eos, so both mixes decode the same number of tokens), rounds alternating the
plain and the constrained mix (a shared machine's load moves both); prints each mix's median
tok/s, the median of each round's ratio, the compile time per distinct schema and the compile
cache's hit rate (each distinct schema compiles once, a request after the first is a hit).
A random: model takes SmolLM2's tokenizer unless `--tokenizer` names another (the grammars
need a real vocabulary: JSON's tokens, not bytes).

    python benchmarks/bench_structured.py                 # CPU: SmolLM2, 16 streams
    python benchmarks/bench_structured.py --device cuda --model random:llama-3.1-8b \
        --concurrency 64 --tokens 256 --rounds 5          # the H200 run
    python benchmarks/bench_structured.py --device cuda --mask-threads 0,pool,4   # the pools
    python benchmarks/bench_structured.py --quick         # random:tiny with SmolLM2's tokenizer,
                                                          # on the CPU, a few seconds (a test)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.model_source import shipped_gguf_path
from memstep.core.sampling_params import SamplingParams
from memstep.executors.process.inprocess import local_engine

COLORS = ["red", "green", "blue", "cyan", "magenta", "yellow", "black", "white"]


def schema(i: int) -> dict:
    """Distinct schema i: a list of records with nested arrays, enums and required fields
    (unbounded, so that a constrained request decodes as many tokens as a plain one)."""
    record = {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "color": {"enum": COLORS[: 2 + i % 7]},
            "grid": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
            "note": {"type": "string"},
        },
        "required": ["id", "color", "grid", "note"],
    }
    return {
        "type": "object",
        "properties": {"items": {"type": "array", "items": record}},
        "required": ["items"],
    }


def mix(streams: int, tokens: int, schemas: int, constrained: bool) -> list[SamplingParams]:
    """Half the requests (the odd ones) with schema (i // 2) % schemas where `constrained`."""
    out = []
    for i in range(streams):
        guided = json.dumps(schema((i // 2) % schemas)) if constrained and i % 2 else ""
        out.append(
            SamplingParams(
                max_tokens=tokens, ignore_eos=True, seed=i, temperature=1.0, guided_json=guided
            )
        )
    return out


def timed(engine: Engine, prompts: list, params: list[SamplingParams]) -> float:
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    return sum(len(c.token_ids) for c in done) / (time.perf_counter() - start)


class MaskClock:
    """Host time in the sampler's `constrain` (the matchers' masks and their application)
    against wall time, over the constrained mix's rounds: a share that a shared machine's load
    moves far less than tok/s, both sides being measured in the same steps."""

    def __init__(self, engine: Engine):
        self.seconds = self.wall = 0.0
        self.on = False
        sampler = engine.executor.worker.sampler  # type: ignore[attr-defined]
        inner = sampler.constrain

        def constrain(logits, rows) -> None:
            start = time.perf_counter()
            inner(logits, rows)
            if self.on:
                self.seconds += time.perf_counter() - start

        sampler.constrain = constrain

    def timed(self, engine: Engine, prompts: list, params: list[SamplingParams]) -> float:
        start, self.on = time.perf_counter(), True
        rate = timed(engine, prompts, params)
        self.wall += time.perf_counter() - start
        self.on = False
        return rate


def config(args: argparse.Namespace) -> EngineConfig:
    model = args.model or ("random:llama-3.1-8b" if args.device == "cuda" else "smollm2")
    tokenizer = args.tokenizer
    if tokenizer is None and model.startswith("random:"):
        tokenizer = str(shipped_gguf_path())
    threads = args.threads if args.device == "cpu" else None
    return EngineConfig(
        model=model,
        tokenizer=tokenizer,
        device=args.device,
        max_num_seqs=args.concurrency,
        num_threads=threads,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", default=None, help="smollm2 on the CPU, random:llama-3.1-8b on CUDA")
    ap.add_argument("--tokenizer", default=None, help="a .gguf or tokenizer.json (random: models)")
    ap.add_argument(
        "--concurrency",
        "--streams",
        type=int,
        default=None,
        help="requests at once: 16 on the CPU, 64 on CUDA",
    )
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--schemas", type=int, default=4, help="distinct schemas in the mix")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--mask-threads",
        default="",
        metavar="N,N",
        help="CUDA: each of these grammar_mask_threads in turn (default: the "
        "config's), e.g. 0,pool,4 (pool: llguidance's default size)",
    )
    quick = "random:tiny, SmolLM2's tokenizer, CPU, 4 requests, 16 tokens"
    ap.add_argument("--quick", action="store_true", help=quick)
    args = ap.parse_args()
    if args.quick:
        args.model, args.device = "random:tiny", "cpu"
        args.concurrency, args.tokens, args.rounds = 4, 16, 1
    args.concurrency = args.concurrency or (64 if args.device == "cuda" else 16)
    engine = local_engine(config(args))
    n = args.concurrency
    prompts = [f"Request {i}: list a few records as JSON." for i in range(n)]
    timed(engine, prompts, mix(n, 4, args.schemas, True))  # warm, and compile
    clock = MaskClock(engine)
    sampler = engine.executor.worker.sampler  # type: ignore[attr-defined]
    for threads in args.mask_threads.split(",") if args.mask_threads else [None]:
        if threads is not None:
            sampler.mask_threads = None if threads == "pool" else int(threads)
            print(f"--- grammar_mask_threads {sampler.mask_threads}")
        plain, guided = [], []
        clock.seconds = clock.wall = 0.0
        for _ in range(args.rounds):
            plain.append(timed(engine, prompts, mix(n, args.tokens, args.schemas, False)))
            guided.append(clock.timed(engine, prompts, mix(n, args.tokens, args.schemas, True)))
        report(args, engine, plain, guided)
        print(
            f"mask         {clock.seconds / clock.wall:9.3f} of the constrained mix's wall time "
            f"in Sampler.constrain ({clock.seconds * 1000:.0f} ms)"
        )
    engine.shutdown()


def report(args: argparse.Namespace, engine: Engine, plain: list, guided: list) -> None:
    ratios = [g / p for p, g in zip(plain, guided, strict=True)]
    model = engine.cfg.model
    name = model + (" (random weights)" if model.startswith("random:") else "")
    tok = engine.cfg.tokenizer
    tokenizer = f" with the tokenizer of {Path(tok).name}" if tok else ""
    print(
        f"{name}{tokenizer}, {args.device}, {args.concurrency} requests at once, "
        f"{args.tokens} tokens each, "
        f"half the requests with one of {args.schemas} JSON schemas"
    )
    print(f"plain        {statistics.median(plain):9.1f} tok/s")
    print(f"half schemas {statistics.median(guided):9.1f} tok/s")
    print(f"ratio        {statistics.median(ratios):9.3f} (median of {len(ratios)} rounds)")
    stats = engine.executor.worker.requests.grammars.stats  # type: ignore[attr-defined]
    per = stats.compile_seconds / max(stats.compiled, 1)
    print(
        f"grammars compiled {stats.compiled}, {per * 1000:.1f} ms each; "
        f"cache hit rate {stats.hit_rate:.3f} ({stats.hits} hits)"
    )


if __name__ == "__main__":
    main()
