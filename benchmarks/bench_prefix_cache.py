"""Prefix caching: TTFT and throughput with it on and off, on a shared and an unshared workload.

Shared: `--num-requests` requests (64) that start with the same system prompt of about
`--system-tokens` tokens (1,000), each followed by its own question.  Unshared: as many ShareGPT
conversations (vLLM's sample, no chat template, so no two prompts share a first block).
Every request arrives at once and generates `--max-tokens` tokens (greedy, EOS ignored).  Each
workload runs in this process with caching on and off, `--repeats` times each in ABBA order
(`--off-first` starts with off); the figures are the mean TTFT (time from arrival to the first
token), the output tokens per second, the requests per second, the CPU seconds, and the ratios of
the medians (TTFT: off / on, so above 1 is better; throughput: on / off).

A 2% cost drowns in the noise of a shared machine, so two more workloads measure it apart:
`paired` serves ShareGPT on two engines in this process, on and off, one step of each in turn
(their plans are checked equal), and `bookkeeping` records every block-manager call of a real
ShareGPT run and replays the trace on a bare block manager, on and off: the fastest of
`--bookkeeping-reps` replays and the exact count of Python calls, per step of the run.

    python benchmarks/bench_prefix_cache.py [--model smollm2] [--num-threads 2]
        [--device cpu] [--dtype float32] [--tokenizer FILE] [--dataset sharegpt|FILE.jsonl]
        [--max-num-seqs N] [--max-num-batched-tokens N] [--num-requests 64]
        [--system-tokens 1000] [--max-tokens 16] [--num-sharegpt 64]
        [--workloads shared,sharegpt,paired,bookkeeping] [--repeats 1] [--off-first]
        [--bookkeeping-reps 30] [--trace FILE] [--save-trace FILE] [--json FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from collections.abc import Callable

import attrs

from memstep.executors.cpu.threads import prefer_passive_wait

# before torch loads: idle OpenMP threads that spin steal the cores of a shared machine, and
# whichever run meets more neighbours loses by far more than caching could cost
prefer_passive_wait()

from memstep.cli.datasets import load_dataset  # noqa: E402
from memstep.core.block_manager import BlockManager, Prefix  # noqa: E402
from memstep.core.config import EngineConfig  # noqa: E402
from memstep.core.engine import Engine  # noqa: E402
from memstep.core.sampling_params import SamplingParams  # noqa: E402
from memstep.events.types import StepPlanned  # noqa: E402
from memstep.executors.process.inprocess import local_engine  # noqa: E402

SYSTEM = (
    "You are the help desk of the city library. Answer briefly and politely. The library opens "
    "at nine and closes at six on weekdays, at four on Saturdays, and stays closed on Sundays. "
    "Members may borrow twelve items at a time for three weeks; a renewal adds two weeks unless "
    "someone else has reserved the item. Fines are ten cents a day for adult books. "
)
QUESTIONS = [
    "When do you open on {}?",
    "How many books can I borrow in {}?",
    "Can I renew a novel about {}?",
    "What is the fine for a late book on {}?",
]
TOPICS = ["Monday", "Saturday", "spring", "gardening", "history", "chess", "poetry", "sailing"]


@attrs.frozen
class Figures:
    mean_ttft_s: float
    p50_ttft_s: float
    output_tok_s: float
    requests_s: float
    cached_prompt_tokens: int
    prompt_tokens: int
    cpu_s: float  # this process's CPU time: less swayed than wall time by a shared machine


FIELDS = [f.name for f in attrs.fields(Figures)]


def shared_prompts(engine: Engine, n: int, system_tokens: int) -> list[list[int]]:
    tok = engine.tokenizer
    system: list[int] = []
    while len(system) < system_tokens:
        system += tok.encode(SYSTEM)
    system = system[:system_tokens]
    questions = [
        q.format(t) + f" (ticket {i})"
        for i, (q, t) in enumerate(
            (QUESTIONS[i % len(QUESTIONS)], TOPICS[i % len(TOPICS)]) for i in range(n)
        )
    ]
    return [system + tok.encode(" " + q) for q in questions]


def serve(engine: Engine, prompts: list[list[int]], max_tokens: int) -> Figures:
    """Add every prompt at once, step until idle; TTFT per request from its arrival."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    cached = 0
    num_out = 0
    while engine.has_work():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
            num_out += len(out.new_token_ids)
            cached += out.cached_tokens if out.finished else 0
    wall = time.perf_counter() - start
    ttfts = [first[i] for i in ids]
    return Figures(
        statistics.mean(ttfts),
        statistics.median(ttfts),
        num_out / wall,
        len(prompts) / wall,
        cached,
        sum(len(p) for p in prompts),
        time.process_time() - cpu,
    )


def workload_prompts(engine: Engine, workload: str, args) -> list[list[int]]:
    if workload == "shared":
        return shared_prompts(engine, args.num_requests, args.system_tokens)
    samples = load_dataset(args.dataset, args.num_sharegpt, engine.tokenizer, seed=args.seed)
    prompts = [engine.tokenizer.encode(s.prompt) for s in samples]
    fits = engine.max_model_len - args.max_tokens  # a small model's context (random:tiny's 512)
    return unshared([p for p in prompts if len(p) <= fits], engine.cfg.block_size)


def unshared(prompts: list[list[int]], block_size: int) -> list[list[int]]:
    """The prompts whose first full block no earlier prompt has (a few ShareGPT conversations
    open alike), so that no prompt can reuse another's page."""
    seen: set[tuple[int, ...]] = set()
    kept = []
    for p in prompts:
        first = tuple(p[:block_size])
        if len(first) < block_size or first not in seen:
            seen.add(first)
            kept.append(p)
    return kept


def run(cfg: EngineConfig, workload: str, args) -> Figures:
    engine = local_engine(cfg)
    try:
        prompts = workload_prompts(engine, workload, args)
        serve(engine, prompts[:1], 2)  # warm the process (allocator, threads) untimed
        engine.blocks.reset()  # ...and forget what that cached
        return serve(engine, prompts, args.max_tokens)
    finally:
        engine.shutdown()


# --- the bookkeeping alone: a recorded trace of block-manager calls, replayed ---------------


class TracedBlocks(BlockManager):
    """The engine's block manager, recording every call the core makes on it and the tokens it
    hashes, so that the bookkeeping can be replayed alone (caching on and off) without the model:
    its per-step cost is then timed over many repetitions and its Python calls counted, which the
    noise of a shared machine cannot blur as it blurs a 2% difference of whole runs."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool):
        super().__init__(num_blocks, block_size, enable_caching)
        self.calls: list[list] = []
        self.tokens: dict[str, list[int]] = {}  # each request's tokens, as far as calls saw them
        self.inside_allocate = False

    def _saw(self, request_id: str, token_at: Callable[[int, int], list[int]], n: int) -> None:
        toks = self.tokens.setdefault(request_id, [])
        if n > len(toks):
            toks += token_at(len(toks), n)

    def lookup(self, tokens: list[int], extra: bytes = b"") -> Prefix:
        prefix = super().lookup(tokens, extra)
        self.calls.append(["lookup", list(tokens), len(prefix.pages)])
        return prefix

    def allocate(self, request_id: str, prefix: Prefix, num_tokens: int) -> bool:
        self.inside_allocate = True  # its own call of ensure is not the core's
        done = super().allocate(request_id, prefix, num_tokens)
        self.inside_allocate = False
        self.calls.append(["allocate", request_id, num_tokens, done])
        return done

    def ensure(self, request_id: str, num_tokens: int) -> bool:
        done = super().ensure(request_id, num_tokens)
        if not self.inside_allocate:
            self.calls.append(["ensure", request_id, num_tokens, done])
        return done

    def commit(self, request_id, num_computed, token_at, extra=b"") -> None:
        self._saw(request_id, token_at, num_computed)
        super().commit(request_id, num_computed, token_at, extra)
        self.calls.append(["commit", request_id, num_computed])

    def free(self, request_id: str) -> int:
        self.calls.append(["free", request_id])
        return super().free(request_id)

    def table(self, request_id: str) -> list[int]:
        self.calls.append(["table", request_id])
        return super().table(request_id)

    @property
    def num_cached(self) -> int:
        self.calls.append(["figures"])  # read once a step, beside num_used
        return super().num_cached


def record_trace(cfg: EngineConfig, args) -> dict:
    """Serve the unshared workload on the real model through a TracedBlocks; the calls, the
    tokens, the number of pages and each step's wall time."""
    engine = local_engine(cfg)
    try:
        prompts = workload_prompts(engine, "sharegpt", args)
        traced = TracedBlocks(engine.blocks.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        engine.scheduler.use_pages(traced, engine.scheduler.decode_lookahead)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, params)
        step_s = []
        while engine.has_work():
            start = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - start)
        return dict(
            num_blocks=traced.num_blocks,
            block_size=traced.block_size,
            calls=traced.calls,
            tokens=traced.tokens,
            step_s=step_s,
        )
    finally:
        engine.shutdown()


def replay_trace(trace: dict, enable_caching: bool) -> BlockManager:
    """Make the trace's calls on a fresh block manager; each answer must be the recorded one."""
    blocks = BlockManager(trace["num_blocks"], trace["block_size"], enable_caching)
    token_at = {rid: _slicer(toks) for rid, toks in trace["tokens"].items()}
    prefix = Prefix()
    for call in trace["calls"]:
        op = call[0]
        if op == "lookup":
            prefix = blocks.lookup(call[1])
            assert len(prefix.pages) == call[2], "a hit differs: replay an unshared trace"
        elif op == "allocate":
            assert blocks.allocate(call[1], prefix, call[2]) == call[3], "an allocation differs"
        elif op == "ensure":
            assert blocks.ensure(call[1], call[2]) == call[3], "a page reservation differs"
        elif op == "commit":
            blocks.commit(call[1], call[2], token_at[call[1]])
        elif op == "free":
            blocks.free(call[1])
        elif op == "table":
            blocks.table(call[1])
        else:
            blocks.num_used, blocks.num_cached  # noqa: B018 -- the engine reads both a step
    return blocks


def _slicer(tokens: list[int]) -> Callable[[int, int], list[int]]:
    return lambda a, b: tokens[a:b]


@attrs.frozen
class Bookkeeping:
    on_step_us: float  # block-manager time a step, caching on: the fastest of the repetitions
    off_step_us: float
    on_calls_step: float  # Python function calls a step (exact, not timed)
    off_calls_step: float
    median_step_ms: float  # the real model's step, in the recorded run
    cost_of_median_step: float  # (on - off) / the median step


def time_bookkeeping(trace: dict, reps: int) -> Bookkeeping:
    """The trace replayed `reps` times each way, alternating; the fastest time of each (noise
    only ever adds time) and the exact count of Python calls, both per step of the run."""
    num_steps = len(trace["step_s"])
    best = {True: float("inf"), False: float("inf")}
    for _ in range(reps):
        for caching in (True, False):
            start = time.perf_counter()
            blocks = replay_trace(trace, caching)
            best[caching] = min(best[caching], time.perf_counter() - start)
            blocks.check()
    calls = {caching: _count_calls(trace, caching) for caching in (True, False)}
    step_ms = statistics.median(trace["step_s"]) * 1e3
    on_us, off_us = (best[c] / num_steps * 1e6 for c in (True, False))
    return Bookkeeping(
        on_us,
        off_us,
        calls[True] / num_steps,
        calls[False] / num_steps,
        step_ms,
        (on_us - off_us) / (step_ms * 1e3),
    )


def _count_calls(trace: dict, caching: bool) -> int:
    prof = cProfile.Profile()
    prof.runcall(replay_trace, trace, caching)
    return pstats.Stats(prof).total_calls  # type: ignore[attr-defined]


# --- side by side: two engines stepped in turn -----------------------------------------------


def paired(base: EngineConfig, args) -> dict:
    """The unshared workload on two engines in this process, caching on and off, stepped in
    turn (which goes first alternates).  With no hit both plan the same batches (checked: their
    plans are equal), so step k is the same model work on each, and both meet the machine's load
    of that moment: the ratio of their step times is caching's cost with most noise cancelled."""
    names = ("on", "off")
    plans: dict[str, list] = {n: [] for n in names}
    step_s: dict[str, list[float]] = {n: [] for n in names}
    cpu_s: dict[str, float] = {n: 0.0 for n in names}
    cfgs = {"on": base, "off": base.replace(enable_prefix_caching=False)}
    engines = {n: local_engine(cfgs[n], [_batches_into(plans[n])]) for n in names}
    try:
        prompts = workload_prompts(engines["on"], "sharegpt", args)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for n, engine in engines.items():
            serve(engine, prompts[:1], 2)  # warm untimed, as `run` does
            engine.blocks.reset()
            plans[n].clear()
            for p in prompts:
                engine.add_request(p, params)
        k = 0
        while any(e.has_work() for e in engines.values()):
            for n in names if k % 2 == 0 else names[::-1]:
                start, cpu = time.perf_counter(), time.process_time()
                engines[n].step()
                step_s[n].append(time.perf_counter() - start)
                cpu_s[n] += time.process_time() - cpu
            k += 1
    finally:
        for engine in engines.values():
            engine.shutdown()
    return _paired_report(plans, step_s, cpu_s)


def _batches_into(batches: list) -> Callable[[object], None]:
    def sink(rec: object) -> None:
        if isinstance(rec, StepPlanned):
            batches.append([rec.kind, rec.batch, rec.cached])

    return sink


def _paired_report(plans: dict, step_s: dict, cpu_s: dict) -> dict:
    ratios = [a / b for a, b in zip(step_s["on"], step_s["off"], strict=True)]
    report = {
        "same_plans": plans["on"] == plans["off"],
        "num_steps": len(ratios),
        "on_s": sum(step_s["on"]),
        "off_s": sum(step_s["off"]),
        "time_ratio": sum(step_s["on"]) / sum(step_s["off"]),
        "median_step_ratio": statistics.median(ratios),
        "cpu_ratio": cpu_s["on"] / cpu_s["off"],
    }
    print(
        f"paired: {report['num_steps']} steps each, plans identical: {report['same_plans']}\n"
        f"  step time on {report['on_s']:.1f} s, off {report['off_s']:.1f} s: on/off "
        f"{report['time_ratio']:.4f} (median step {report['median_step_ratio']:.4f}, CPU "
        f"{report['cpu_ratio']:.4f})",
        flush=True,
    )
    return report


def show(name: str, f: Figures) -> None:
    print(
        f"  caching {name:>3}: mean TTFT {f.mean_ttft_s:8.2f} s (p50 {f.p50_ttft_s:.2f}), "
        f"{f.output_tok_s:7.2f} out tok/s, {f.requests_s:.3f} req/s, {f.cpu_s:.1f} CPU s; hit rate "
        f"{f.cached_prompt_tokens / f.prompt_tokens:.1%} of {f.prompt_tokens} prompt tokens",
        flush=True,
    )


def compare(base: EngineConfig, workload: str, args) -> dict:
    """Caching on and off, `--repeats` times each, alternating (ABBA); the medians' ratios."""
    num = args.num_requests if workload == "shared" else args.num_sharegpt
    print(f"{workload}: {num} requests, {args.max_tokens} tokens each", flush=True)
    cfgs = {"on": base, "off": base.replace(enable_prefix_caching=False)}
    order = ["off", "on"] if args.off_first else ["on", "off"]
    runs: dict[str, list[Figures]] = {"on": [], "off": []}
    for i in range(args.repeats):
        for name in order if i % 2 == 0 else order[::-1]:
            runs[name].append(run(cfgs[name], workload, args))
            show(name, runs[name][-1])
    med = {
        k: {f: statistics.median(getattr(r, f) for r in v) for f in FIELDS} for k, v in runs.items()
    }
    report = {
        "on": [attrs.asdict(r) for r in runs["on"]],
        "off": [attrs.asdict(r) for r in runs["off"]],
        "ttft_speedup": med["off"]["mean_ttft_s"] / med["on"]["mean_ttft_s"],
        "throughput_speedup": med["on"]["output_tok_s"] / med["off"]["output_tok_s"],
        "cpu_ratio": med["on"]["cpu_s"] / med["off"]["cpu_s"],
    }
    print(
        f"  ratio of medians ({args.repeats} each): TTFT {report['ttft_speedup']:.3f}x better, "
        f"throughput {report['throughput_speedup']:.3f}x, CPU seconds on/off "
        f"{report['cpu_ratio']:.3f}",
        flush=True,
    )
    return report


def bookkeeping(base: EngineConfig, args) -> dict:
    """The block manager's cost a step on the unshared workload, from a recorded trace."""
    if args.trace:
        with open(args.trace) as fh:
            trace = json.load(fh)
    else:
        trace = record_trace(base, args)
    if args.save_trace:
        with open(args.save_trace, "w") as fh:
            json.dump(trace, fh)
    b = time_bookkeeping(trace, args.bookkeeping_reps)
    print(
        f"bookkeeping: {len(trace['calls'])} block-manager calls over {len(trace['step_s'])} "
        f"steps, replayed {args.bookkeeping_reps}x each way\n"
        f"  a step: caching on {b.on_step_us:.1f} us, off {b.off_step_us:.1f} us; Python calls "
        f"on {b.on_calls_step:.1f}, off {b.off_calls_step:.1f}; the model's median step "
        f"{b.median_step_ms:.1f} ms, so caching costs {b.cost_of_median_step:.4%} of a step",
        flush=True,
    )
    return attrs.asdict(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json or .gguf (random: models)")
    ap.add_argument("--dataset", default="sharegpt", help="sharegpt, or a JSONL file of prompts")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="the engine's default")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the same")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--num-sharegpt", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", default="shared,sharegpt,paired,bookkeeping")
    ap.add_argument("--off-first", action="store_true", help="run caching off before on")
    ap.add_argument("--repeats", type=int, default=1, help="runs each way, alternating")
    ap.add_argument("--bookkeeping-reps", type=int, default=30, help="replays of the trace")
    ap.add_argument("--trace", default=None, help="replay this trace instead of recording one")
    ap.add_argument("--save-trace", default=None, help="write the recorded trace here (JSON)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    base = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        num_threads=args.num_threads,
        tokenizer=args.tokenizer,
    )
    limits = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    base = base.replace(**{k: v for k, v in limits.items() if v is not None})
    special = {"bookkeeping": bookkeeping, "paired": paired}
    report = {
        w: special[w](base, args) if w in special else compare(base, w, args)
        for w in args.workloads.split(",")
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
