"""EAGLE with the defaults against speculation off, as a user meets it: two in-process `LLM`s.

One `LLM` plain, one with `speculative_method="eagle"` (K = `--k`) and every other setting as
shipped (the automatic threshold and adaptive K on, unless `--forced`), SmolLM2 and its committed
head; two chat prompts, `--tokens` greedy tokens each (`ignore_eos`), at `--streams` streams (the
prompts alternated to fill them; one stream runs them one after the other). The two `LLM`s run
in alternating order each round (plain first, then eagle first), so that a shared machine's load
moves both; prints each one's median tok/s over `--rounds`, the median of the rounds' ratios,
the drafts proposed and accepted a spec step, and the spec/no_spec steps the engine ran.

    python benchmarks/bench_spec_chat.py [--streams 1] [--rounds 3] [--k 2] [--forced]
"""

from __future__ import annotations

import argparse
import statistics
import time

from memstep.executors.cpu.threads import prefer_passive_wait

prefer_passive_wait()  # as `memstep generate` runs: the policy must be set before torch loads

from memstep import LLM, SamplingParams  # noqa: E402
from memstep.events.types import StepFinished  # noqa: E402

CHATS = [
    "Write a short story about a dragon who learns to bake bread.",
    "Explain how vaccines train the immune system.",
]


def timed(llm: LLM, streams: int, tokens: int, steps: list[StepFinished]) -> float:
    """Tokens per second of `streams` chats (one at a time at one stream); StepFinished into
    `steps`."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    chats = [[{"role": "user", "content": CHATS[i % len(CHATS)]}] for i in range(max(2, streams))]
    sink = llm.engine.sinks

    def keep(record: object) -> None:
        if isinstance(record, StepFinished):
            steps.append(record)

    sink.append(keep)
    start = time.perf_counter()
    for i in range(0, len(chats), streams):
        llm.chat(chats[i : i + streams], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    sink.pop()
    return len(chats) * tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--forced", action="store_true", help="speculative_auto_disable, _adaptive_k off"
    )
    args = ap.parse_args()
    common = {"num_threads": args.threads, "max_num_seqs": max(8, args.streams)}
    plain = LLM(**common)
    auto = {} if not args.forced else {"speculative_auto_disable": False}
    adaptive = {} if not args.forced else {"speculative_adaptive_k": False}
    eagle = LLM(
        speculative_method="eagle", num_speculative_tokens=args.k, **common, **auto, **adaptive
    )
    warm = SamplingParams(temperature=0.0, max_tokens=4)
    for llm in (plain, eagle):
        llm.generate([[1, 2, 3]], warm, use_tqdm=False)
    rates: dict[str, list[float]] = {"plain": [], "eagle": []}
    steps: list[StepFinished] = []
    for r in range(args.rounds):
        order = [("plain", plain), ("eagle", eagle)][:: 1 if r % 2 == 0 else -1]
        for name, llm in order:
            kept = steps if name == "eagle" else []
            rates[name].append(timed(llm, args.streams, args.tokens, kept))
    ratios = [e / p for e, p in zip(rates["eagle"], rates["plain"], strict=True)]
    spec = [s for s in steps if s.kind == "spec"]
    proposed = sum(s.num_proposed for s in spec)
    accepted = sum(s.num_accepted for s in spec)
    seq_steps = sum(len(s.sampled) for s in spec)
    print(
        f"streams {args.streams}  k {args.k}  {'forced' if args.forced else 'defaults'}  "
        f"rounds {args.rounds}  tokens {args.tokens}"
    )
    print(f"plain  {statistics.median(rates['plain']):8.1f} tok/s (median)")
    print(f"eagle  {statistics.median(rates['eagle']):8.1f} tok/s (median)")
    each = ", ".join(f"{x:.2f}" for x in ratios)
    print(f"ratio  {statistics.median(ratios):8.2f}x (median of rounds: {each})")
    print(
        f"eagle steps: {len(spec)} spec, {len(steps) - len(spec)} no_spec; per request and spec "
        f"step {proposed / max(1, seq_steps):.2f} proposed, {accepted / max(1, seq_steps):.2f} "
        "accepted"
    )
    for llm in (plain, eagle):
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
