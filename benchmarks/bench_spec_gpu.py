"""Speculative decoding on a GPU: tokens/s with each method against none, in one process.

4 streams of greedy requests (64 tokens each, prompts of 40-49 token ids), K = 2, in bfloat16;
a warm-up batch, then `--rounds` timed batches (each with prompts of its own, so no prefix-cache
hits) per method; prints the median. The default model is `random:smollm2-135m`, whose weights
fit no transformer file to carry to a GPU machine; its greedy output repeats itself, so `ngram`
has drafts accepted, while the SmolLM2 EAGLE head (trained on the real model) has none accepted.

    python benchmarks/bench_spec_gpu.py [--model random:smollm2-135m] [--methods none,ngram,eagle]
        [--rounds 3] [--k 2]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch

STREAMS, TOKENS = 4, 64


def tok_per_s(method: str, options) -> float:
    from memstep.core.config import EngineConfig
    from memstep.core.sampling_params import SamplingParams
    from memstep.executors.process.inprocess import local_engine
    from memstep.executors.spec.eagle import SMOLLM2_HEAD

    head = SMOLLM2_HEAD
    spec = {} if method == "none" else {"speculative_method": method}
    if method == "eagle":
        spec["draft_model"] = str(head)
    cfg = EngineConfig(
        model=options.model,
        dtype="bfloat16",
        num_speculative_tokens=options.k,
        gpu_memory_utilization=0.3,
        **spec,
    )
    engine = local_engine(cfg)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    times = []
    try:
        for run in range(options.rounds + 1):  # the first warms up
            prompts = [
                [1 + (run * 7919 + i * 37 + j * 11) % 4000 for j in range(40 + 3 * i)]
                for i in range(STREAMS)
            ]
            start = time.perf_counter()
            engine.generate(prompts, params)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    finally:
        engine.shutdown()
    return STREAMS * TOKENS / statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--methods", default="none,ngram,eagle")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=2)
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_spec_gpu needs a CUDA device")
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    for method in options.methods.split(","):
        rate = tok_per_s(method, options)
        print(f"{method}: {rate:,.0f} tok/s ({STREAMS} streams, K = {options.k})", flush=True)


if __name__ == "__main__":
    main()
