"""Speculation under load: `ngram` against plain decoding at 1, 16, 64 and 256 concurrent
requests on repeating text, the engine's automatic disable threshold on (the default).

Each concurrency runs a warm-up batch (CUDA graphs, and the threshold's first measurements at
that batch size), then `--rounds` timed batches, each with prompts of its own (no prefix-cache
hits): a random run of 24 token ids said four times, greedy, `--tokens` new tokens each. An
engine per method, one after the other; prints each concurrency's median tok/s, the ratio of
the medians, the drafts' acceptance and the share of spec steps, and the automatic thresholds
the speculating engine recorded.

    python benchmarks/bench_spec_load.py [--model random:llama-3.1-8b] [--concurrency 1,16,64,256]
        [--tokens 128] [--rounds 3] [--k 3] [--methods none,ngram] [--quick]

`--quick` (CPU, random:tiny, 1 and 4 streams, 16 tokens, one round) checks the script; the
figures that matter are the H200's (`random:` weights, always labelled random).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

import attrs

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import SpecThresholdChanged, StepFinished
from memstep.executors.process.inprocess import local_engine


@attrs.define
class Tally:
    """What one method did at one concurrency over the timed rounds."""

    rates: list[float] = attrs.Factory(list)  # tok/s per round
    proposed: int = 0
    accepted: int = 0
    spec_steps: int = 0
    steps: int = 0

    def see(self, rec: object) -> None:
        if isinstance(rec, StepFinished):
            self.proposed += rec.num_proposed
            self.accepted += rec.num_accepted
            self.spec_steps += rec.kind == "spec"
            self.steps += 1


def repeating_prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    """n prompts, each a random run of 24 ids (from `seed`) said four times."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(24)] * 4 for _ in range(n)]


def one_round(engine: Engine, n: int, seed: int, tokens: int, tally: Tally | None) -> float:
    """Serve n repeating prompts at once; tok/s of the whole batch."""
    prompts = repeating_prompts(n, seed, min(engine.model_cfg.vocab_size, 30000))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    if tally is not None:
        engine.sinks.append(tally.see)
    start = time.perf_counter()
    engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    if tally is not None:
        engine.sinks.remove(tally.see)
    return n * tokens / elapsed


def measure(cfg: EngineConfig, options) -> tuple[dict[int, Tally], list[SpecThresholdChanged]]:
    """Per concurrency, the timed rounds of one engine; and the thresholds it recorded."""
    thresholds: list[SpecThresholdChanged] = []

    def keep(rec: object) -> None:
        if isinstance(rec, SpecThresholdChanged):
            thresholds.append(rec)

    engine = local_engine(cfg, sinks=[keep])
    tallies: dict[int, Tally] = {}
    try:
        for n in options.concurrency:
            one_round(engine, n, seed=n, tokens=options.tokens, tally=None)  # warm-up
            tally = tallies[n] = Tally()
            for r in range(options.rounds):
                rate = one_round(
                    engine, n, seed=1000 * (r + 1) + n, tokens=options.tokens, tally=tally
                )
                tally.rates.append(rate)
    finally:
        engine.shutdown()
    return tallies, thresholds


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--methods", default="none,ngram", help="comma-separated; none first")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quick", action="store_true", help="CPU, random:tiny, 1 and 4, 16 tokens")
    options = ap.parse_args(argv)
    if options.quick:
        options.model, options.concurrency, options.tokens, options.rounds = (
            "random:tiny",
            "1,4",
            16,
            1,
        )
    options.concurrency = [int(c) for c in options.concurrency.split(",")]
    options.methods = options.methods.split(",")
    return options


def config(options, method: str) -> EngineConfig:
    spec = {} if method == "none" else {"speculative_method": method}
    most = max(options.concurrency)
    return EngineConfig(
        model=options.model,
        dtype=options.dtype,
        device="cpu" if options.quick else "auto",
        num_threads=1 if options.quick else None,
        max_num_seqs=most,
        max_num_batched_tokens=max(2048, most * (options.k + 1)),
        num_speculative_tokens=options.k,
        enable_prefix_caching=False,
        **spec,
    )


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    if not options.quick:
        import structlog

        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    results = {m: measure(config(options, m), options) for m in options.methods}
    base = results[options.methods[0]][0]
    print(
        f"model {options.model}, greedy, {options.tokens} tokens, K = {options.k}, "
        f"medians of {options.rounds} rounds"
    )
    print(
        f"{'method':<7} {'conc':>5} {'tok/s':>10} {'vs none':>8} {'accept':>7} {'spec steps':>10}"
    )
    for method, (tallies, _) in results.items():
        for n, t in tallies.items():
            rate = statistics.median(t.rates)
            ratio = rate / statistics.median(base[n].rates)
            accept = t.accepted / t.proposed if t.proposed else 0.0
            share = t.spec_steps / t.steps if t.steps else 0.0
            print(f"{method:<7} {n:>5} {rate:>10.1f} {ratio:>7.2f}x {accept:>7.2f} {share:>10.0%}")
    for method, (_, thresholds) in results.items():
        if method != "none":
            shown = ", ".join(f"step {t.step}: {t.threshold}" for t in thresholds) or "none"
            print(f"{method} automatic thresholds: {shown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
