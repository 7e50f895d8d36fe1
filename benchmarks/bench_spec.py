"""Speculative decoding on SmolLM2: acceptance and tokens/s, with and without each proposer.

Runs in one process, an engine per method (none, ngram, draft, eagle): for a copy-inviting
workload (quote a passage back), an edit workload (give a passage back changed) and free
generation, greedy, 64 new tokens, at concurrency 1 and 8, each method in turn, `--rounds`
times; prints the median tok/s, the median of each round's ratio to no speculation (run a moment
before, so that a shared machine's load moves both), the acceptance rate, the mean accepted
drafts per spec step, how many of its requests gave the very tokens of no speculation, and the
median time a step, and what the automatic threshold and adaptive K cost the core a step (the
time in `Engine._observe_cost` and `OutputBook._adapt_k`, in microseconds). `--forced` makes every
step a spec step (no automatic threshold, no adaptive K): what a spec step costs against a
plain one.

    python benchmarks/bench_spec.py [--tokens 64] [--draft-layers 8] [--k 3] [--methods none,eagle]
        [--rounds 3] [--draft-model HEAD.npz] [--tree 3,2] [--workloads copy,edit,free]
    python benchmarks/bench_spec.py --device cuda --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --tokens 128 --concurrency 1 --methods none,ngram,eagle,eagle-tree --k 3
        (issue 43's one stream on a GPU: the GGUF's weights, bfloat16)

`eagle-tree` in `--methods` is `eagle` drafting a tree of `--tree`'s widths (speculative_tree).

The engine runs as `memstep generate` does on the CPU (the GGUF's q4 blocks, the passive OpenMP
wait policy unless the environment names one: executors/cpu/threads.py); `--threads` sets torch's
threads (the issue's figures: 2).
"""

from __future__ import annotations

import argparse
import statistics
import time

from memstep.executors.cpu.threads import prefer_passive_wait

prefer_passive_wait()  # as `memstep generate` runs: the policy must be set before torch loads

from memstep.core.config import EngineConfig  # noqa: E402
from memstep.core.engine import Engine  # noqa: E402
from memstep.core.sampling_params import SamplingParams  # noqa: E402
from memstep.events.types import StepFinished  # noqa: E402
from memstep.executors.process.inprocess import local_engine  # noqa: E402

PASSAGE = (
    "The lighthouse stood at the edge of the cliff for two hundred years. Every night its lamp "
    "turned slowly, throwing a long white beam across the water, and every morning the keeper "
    "climbed the one hundred and twelve steps to polish the glass and trim the wick."
)
COPY = [
    f"Quote this passage back to me word for word:\n\n{PASSAGE}",
    f"Repeat the following text exactly, then stop:\n\n{PASSAGE}",
]
TYPOS = PASSAGE.replace("stood", "stod").replace("slowly", "slowy").replace("glass", "glas")
EDIT = [
    f"Rewrite this passage with 'tower' in place of 'lighthouse', changing nothing else:\n\n"
    f"{PASSAGE}",
    f"Correct the spelling mistakes in this passage and give it back in full:\n\n{TYPOS}",
]
FREE = [
    "Write a short story about a dragon who learns to bake bread.",
    "Explain how vaccines train the immune system.",
]


class Overhead:
    """Seconds the engine spends in its speculation choices (the engine's `_observe_cost`: the
    automatic threshold; its output book's `_adapt_k`: adaptive K), wrapped around their own
    methods."""

    def __init__(self, engine: Engine):
        self.seconds = 0.0
        for owner, name in ((engine, "_observe_cost"), (engine.book, "_adapt_k")):
            setattr(owner, name, self.timed(getattr(owner, name)))

    def timed(self, method):
        def wrapper(*args):
            start = time.perf_counter()
            method(*args)
            self.seconds += time.perf_counter() - start

        return wrapper


def run(
    engine: Engine, prompts: list[str], concurrency: int, tokens: int
) -> tuple[float, int, int, int, list[list[int]], float, float]:
    tok = engine.tokenizer
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    work = [ids[i % len(ids)] for i in range(max(concurrency, 2))]
    steps: list[StepFinished] = []
    sink = steps.append
    engine.sinks.append(lambda r: isinstance(r, StepFinished) and sink(r))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    overhead = getattr(engine, "overhead", None) or Overhead(engine)
    engine.overhead = overhead  # type: ignore[attr-defined]
    spent = overhead.seconds
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(work), concurrency):
        outputs += [c.token_ids for c in engine.generate(work[i : i + concurrency], params)]
    elapsed = time.perf_counter() - start
    engine.sinks.pop()
    out = len(work) * tokens
    proposed = sum(s.num_proposed for s in steps)
    accepted = sum(s.num_accepted for s in steps)
    spec_seq_steps = sum(len(s.sampled) for s in steps if s.kind == "spec")
    ms_a_step = 1000 * elapsed / max(1, len(steps))
    us_choices = 1e6 * (overhead.seconds - spent) / max(1, len(steps))
    return out / elapsed, proposed, accepted, spec_seq_steps, outputs, ms_a_step, us_choices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument(
        "--methods", default="none,ngram,draft,eagle", help="comma-separated; none first"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-model", default=None, help="an EAGLE head .npz (default: committed)")
    ap.add_argument("--rounds", type=int, default=3, help="each a run of every method in turn")
    ap.add_argument("--tree", default="3,2", help="eagle-tree: the draft tree's widths")
    ap.add_argument("--workloads", default="copy,free", help="comma-separated: copy, edit, free")
    ap.add_argument("--model", default="smollm2", help="the target (a GGUF path on a GPU host)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--gpu-memory-utilization", type=float, default=0.15, help="each engine's (CUDA)"
    )
    ap.add_argument("--concurrency", default="1,8", help="comma-separated stream counts")
    ap.add_argument(
        "--prefix-caching", action="store_true", help="keep prefix caching on (later rounds hit)"
    )
    ap.add_argument(
        "--forced",
        action="store_true",
        help="every step a spec step: no automatic threshold, no adaptive K (what a step costs)",
    )
    args = ap.parse_args()
    methods = [None if m == "none" else m for m in args.methods.split(",")]
    engines = {}
    for method in methods:
        tree = tuple(int(w) for w in args.tree.split(",")) if method == "eagle-tree" else ()
        cfg = EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_threads=args.threads,
            max_num_seqs=8,
            speculative_method="eagle" if tree else method,
            speculative_tree=tree,
            num_speculative_tokens=args.k,
            draft_layers=args.draft_layers,
            draft_model=args.draft_model if method in ("eagle", "eagle-tree") else None,
            # every round reads its prompts whole, as the first does: the EAGLE head's context
            # gets the pairs of the prompt's computed positions only, none of a cached prefix
            enable_prefix_caching=args.prefix_caching,
            speculative_auto_disable=not args.forced,
            speculative_adaptive_k=not args.forced,
        )
        engines[method] = local_engine(cfg)
    # warmed once all are loaded: each engine's host-memory baseline (its first step's resident
    # set, this whole process's) then holds every engine, and no later load reads as growth
    for engine in engines.values():
        engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))
    # per (method, workload, concurrency): each round's tok/s, its ratio to that round's first
    # method (run a moment before), and the drafts' counts
    runs: dict[tuple, list[tuple[float, float, int, int, int, int, int, float, float]]] = {}
    for _ in range(args.rounds):
        for name in args.workloads.split(","):
            prompts = {"copy": COPY, "edit": EDIT, "free": FREE}[name]
            for conc in (int(c) for c in args.concurrency.split(",")):
                first, plain = None, None
                for method, engine in engines.items():
                    tps, proposed, accepted, seq_steps, outs, ms, us = run(
                        engine, prompts, conc, args.tokens
                    )
                    first, plain = first or tps, plain or outs
                    same = sum(a == b for a, b in zip(outs, plain, strict=True))
                    entry = (
                        tps,
                        tps / first,
                        proposed,
                        accepted,
                        seq_steps,
                        same,
                        len(outs),
                        ms,
                        us,
                    )
                    runs.setdefault((method, name, conc), []).append(entry)
    for engine in engines.values():
        engine.shutdown()
    print(
        f"{'method':<10} {'workload':<5} {'conc':>4} {'tok/s':>8} {'vs none':>8} "
        f"{'accept':>7} {'mean acc len':>12} {'as none':>8} {'ms/step':>8} {'choice us':>9}"
        f"   (medians of {args.rounds} rounds)"
    )
    for (method, name, conc), entries in runs.items():
        proposed = sum(e[2] for e in entries)
        accepted = sum(e[3] for e in entries)
        seq_steps = sum(e[4] for e in entries)
        rate = accepted / proposed if proposed else 0.0
        mean_len = accepted / seq_steps if seq_steps else 0.0
        tps = statistics.median(e[0] for e in entries)
        ratio = statistics.median(e[1] for e in entries)
        as_none = f"{sum(e[5] for e in entries)}/{sum(e[6] for e in entries)}"
        print(
            f"{method or 'none':<10} {name:<5} {conc:>4} {tps:>8.1f} {ratio:>7.2f}x "
            f"{rate:>7.2f} {mean_len:>12.2f} {as_none:>8} "
            f"{statistics.median(e[7] for e in entries):>8.2f} "
            f"{statistics.median(e[8] for e in entries):>9.1f}"
        )


if __name__ == "__main__":
    main()
