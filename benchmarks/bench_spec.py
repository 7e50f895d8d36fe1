"""Speculative decoding on SmolLM2: acceptance and tokens/s, with and without each proposer.

Runs in one process: for each method (none, ngram, draft, eagle) and concurrency (1, 8), a
copy-inviting workload (quote a passage back) and free generation, greedy, 64 new tokens;
prints tok/s, the ratio to no speculation in the same run, and the acceptance rate and mean
accepted length.

    python benchmarks/bench_spec.py [--tokens 64] [--draft-layers 8] [--k 3] [--methods none,eagle]

The engine runs as `memstep generate` does on the CPU (the GGUF's q4 blocks); `--threads` sets
torch's threads (the issue's figures: 2).
"""

from __future__ import annotations

import argparse
import time

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import StepFinished
from memstep.executors.inprocess import local_engine

PASSAGE = (
    "The lighthouse stood at the edge of the cliff for two hundred years. Every night its lamp "
    "turned slowly, throwing a long white beam across the water, and every morning the keeper "
    "climbed the one hundred and twelve steps to polish the glass and trim the wick."
)
COPY = [
    f"Quote this passage back to me word for word:\n\n{PASSAGE}",
    f"Repeat the following text exactly, then stop:\n\n{PASSAGE}",
]
FREE = [
    "Write a short story about a dragon who learns to bake bread.",
    "Explain how vaccines train the immune system.",
]


def run(
    engine: Engine, prompts: list[str], concurrency: int, tokens: int
) -> tuple[float, int, int, int]:
    tok = engine.tokenizer
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    work = [ids[i % len(ids)] for i in range(max(concurrency, 2))]
    steps: list[StepFinished] = []
    sink = steps.append
    engine.sinks.append(lambda r: isinstance(r, StepFinished) and sink(r))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    for i in range(0, len(work), concurrency):
        engine.generate(work[i : i + concurrency], params)
    elapsed = time.perf_counter() - start
    engine.sinks.pop()
    out = len(work) * tokens
    proposed = sum(s.num_proposed for s in steps)
    accepted = sum(s.num_accepted for s in steps)
    spec_seq_steps = sum(len(s.sampled) for s in steps if s.kind == "spec")
    return out / elapsed, proposed, accepted, spec_seq_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument(
        "--methods", default="none,ngram,draft,eagle", help="comma-separated; none first"
    )
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    base: dict[tuple[str, int], float] = {}
    print(
        f"{'method':<7} {'workload':<5} {'conc':>4} {'tok/s':>8} {'vs none':>8} "
        f"{'accept':>7} {'mean acc len':>12}"
    )
    methods = [None if m == "none" else m for m in args.methods.split(",")]
    for method in methods:
        cfg = EngineConfig(
            num_threads=args.threads,
            max_num_seqs=8,
            speculative_method=method,
            num_speculative_tokens=args.k,
            draft_layers=args.draft_layers,
        )
        engine = local_engine(cfg)
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm
        for name, prompts in (("copy", COPY), ("free", FREE)):
            for conc in (1, 8):
                tps, proposed, accepted, seq_steps = run(engine, prompts, conc, args.tokens)
                base.setdefault((name, conc), tps)
                rate = accepted / proposed if proposed else 0.0
                mean_len = accepted / seq_steps if seq_steps else 0.0
                print(
                    f"{method or 'none':<7} {name:<5} {conc:>4} {tps:>8.1f} "
                    f"{tps / base[(name, conc)]:>7.2f}x {rate:>7.2f} {mean_len:>12.2f}"
                )
        engine.shutdown()


if __name__ == "__main__":
    main()
