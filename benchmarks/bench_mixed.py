"""Mixed steps and whole runs on a GPU against an ideal engine, in one run (issue 15, Must show 3).

On random:llama-3.1-8b in bf16, one engine (256 sequences, 8,192 batched tokens):

- the device's copy bandwidth and bf16 matmul rate;
- the decode step at 256 sequences (graph replay + head) and a mixed step (the same 256 decodes
  beside a 512-token prompt chunk, + the head over the 257 sampled rows), for a chunk that
  starts its prompt and for one that continues it; the goal is mixed <= 1.5 x (decode step +
  the chunk's FLOPs at the matmul rate);
- where a mixed step's time goes: host time to build and launch it, the sum of its kernels'
  device time (a profile), and its kernels by name;
- 64 and 256 concurrent requests of 128 prompt + 128 output tokens through the engine, against
  an ideal engine: every prompt's FLOPs at the matmul rate, then each decode step at its roofline
  (the larger of weights + KV read at the copy bandwidth and its FLOPs at the matmul rate); the
  goal is >= 85% of the ideal's tokens/s.

    python benchmarks/bench_mixed.py [--out DIR] [--repeats 3] [--iters 10] [--no-piecewise]

The engine serves with its piecewise graphs (executors/cuda/piecewise.py, on by default), and the
mixed step is timed through them beside the eager rows ("packed", "unpacked");
`--no-piecewise` serves and times without them.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
from common import (
    MODEL,
    PROMPT_LEN,
    StepClock,
    copy_bandwidth,
    decode_feeds,
    ideal_run,
    kernel_profile,
    kernel_times,
    matmul_rate,
    model_step_ms,
    random_prompts,
    run_throughput,
)

DECODES, CHUNK = 256, 512
CONTEXT = 192  # the decodes' context, as bench_gpu's decode steps


def mixed_feeds(worker, chunk_start: int):
    """256 decodes at CONTEXT beside one CHUNK-token chunk of a prompt starting at
    `chunk_start` (0: the prompt's first chunk; else its cached prefix is that long)."""
    from memstep.core.shapes import cdiv
    from memstep.events.plan import SeqPlan

    block = worker.cfg.block_size
    feeds = decode_feeds(DECODES, CONTEXT, block)
    first_page = max(page for seq, _ in feeds for page in seq.block_table) + 1
    pages = list(range(first_page, first_page + cdiv(chunk_start + CHUNK, block)))
    chunk = SeqPlan("chunk", chunk_start, [7] * CHUNK, pages, True, 0, chunk_start + CHUNK)
    return [*feeds, (chunk, chunk.token_ids)]


def timed_step(worker, feeds, iters: int, mode: str = "packed") -> dict:
    """Building the batch, forward and head over each feed's last row, from a quiet device to
    the last kernel's end (wall clock: host work counts), and the kernels' own time in a
    profile. `mode`: "packed" runs the model's eager forward; "unpacked" the same with every
    chunk its own attention call, as before the packed group; "piecewise" the worker's
    forward, which replays the piecewise graphs (`--piecewise`)."""
    from memstep.executors.runtime.batch_builder import build_batch

    model = worker.model
    worker.graphs.drop_ahead()

    def run():
        if mode == "piecewise":
            hidden, last_rows = worker.forward(feeds)
            return model.logits(hidden[last_rows])
        batch, last_rows = build_batch(
            feeds, worker.cfg.block_size, worker.device, packed=mode == "packed"
        )
        return model.logits(model.forward(batch, worker.kv)[last_rows])

    with torch.inference_mode():
        for _ in range(10):  # new shapes: Triton specializations, allocator blocks
            run()
        walls = []
        for _ in range(iters):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - start) * 1e3)
        kernels = kernel_times(run, 3)
    return {
        "step_ms": round(statistics.median(walls), 3),
        "kernels_ms": round(sum(k["ms_per_run"] for k in kernels), 3),
        "kernels": [{**k, "ms_per_run": round(k["ms_per_run"], 4)} for k in kernels[:12]],
    }


def prefill_feeds(worker, lengths: list[int], first_page: int = 0):
    """Fresh prompts of `lengths` tokens, as a step of prefills only."""
    from memstep.core.shapes import cdiv
    from memstep.events.plan import SeqPlan

    feeds = []
    for i, length in enumerate(lengths):
        pages = list(range(first_page, first_page + cdiv(length, worker.cfg.block_size)))
        first_page += len(pages)
        seq = SeqPlan(f"p{i}", 0, [9] * length, pages, True, 0, length)
        feeds.append((seq, seq.token_ids))
    return feeds


def arrivals_run(engine, clock, vocab: int, running: int, per_step: int, steps: int) -> dict:
    """Serving's steady state in one process: `running` requests decoding while `per_step`
    new ones (128-token prompts, 8 tokens out) arrive every step, so every step is a mixed
    step run eagerly. Medians of the steps' wall time split as StepClock splits it."""
    from memstep.core.sampling_params import SamplingParams

    long = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for prompt in random_prompts(running, PROMPT_LEN, vocab, 77):
        engine.add_request(prompt, long)
    while len(engine.scheduler.running) < running:
        clock.step()
    clock.records.clear()
    for i in range(steps):
        for prompt in random_prompts(per_step, PROMPT_LEN, vocab, 10_000 + i):
            engine.add_request(prompt, short)
        clock.step()
    keys = ("total", "forward", "worker_execute", "executor_execute")
    med = {k: statistics.median(r.get(k, 0.0) for r in clock.records) * 1e3 for k in keys}
    while engine.has_work():
        clock.step()
    return {
        "running": running,
        "new_per_step": per_step,
        "step_ms": round(med["total"], 2),
        "forward_host_ms": round(med["forward"], 2),
        "executor_ms": round(med["executor_execute"], 2),
        "engine_core_ms": round(med["total"] - med["executor_execute"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--repeats", type=int, default=3, help="runs per concurrency (median)")
    parser.add_argument("--iters", type=int, default=10, help="timed mixed steps (median)")
    parser.add_argument(
        "--no-piecewise",
        dest="piecewise",
        action="store_false",
        help="serve without piecewise graphs, and do not time them",
    )
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mixed needs a CUDA device")
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from memstep.core.config import EngineConfig
    from memstep.core.model_source import model_config, resolve
    from memstep.executors.process.inprocess import local_engine

    bandwidth, rate = copy_bandwidth(), matmul_rate()
    report: dict = {
        "device": torch.cuda.get_device_name(),
        "model": f"{MODEL} bf16",
        "copy_bw_tb_s": round(bandwidth / 1e12, 3),
        "matmul_tflops": round(rate / 1e12, 1),
    }
    print(f"copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    model_cfg = model_config(resolve(MODEL, 0))
    cfg = EngineConfig(
        model=MODEL,
        dtype="bfloat16",
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        piecewise_graphs=options.piecewise,
    )
    report["piecewise_graphs"] = options.piecewise
    engine = local_engine(cfg)
    worker = engine.executor.worker
    # the bytes a decode step reads, all but the embedding table (it gathers rows of it); as
    # bf16, half as many parameters, each a multiply-add per token
    weight_bytes = sum(
        t.numel() * t.element_size() for name, t in worker.weights.items() if name != "embed"
    )
    flops_per_token = weight_bytes  # 2 x (weight_bytes / 2) parameters

    for batch in (64, 256):
        report[f"decode_step_{batch}"] = model_step_ms(worker, batch, CONTEXT)
        report[f"decode_kernels_{batch}"] = kernel_profile(worker, batch, CONTEXT)
    decode = report["decode_step_256"]
    ideal_ms = decode["graph_plus_head_ms"] + CHUNK * flops_per_token / rate * 1e3
    report["mixed"] = []
    modes = ["piecewise"] * options.piecewise + ["packed", "unpacked"]
    for start in (0, 512):
        for mode in modes:
            feeds = mixed_feeds(worker, start)
            mixed = {"chunk_start": start, "mode": mode}
            mixed |= timed_step(worker, feeds, options.iters, mode)
            mixed["ideal_ms"] = round(ideal_ms, 3)
            mixed["ratio_to_ideal"] = round(mixed["step_ms"] / ideal_ms, 3)
            report["mixed"].append(mixed)
            print(
                f"mixed step (256 decodes + {CHUNK}-token chunk at {start}, {mode}):"
                f" {mixed['step_ms']} ms, kernels {mixed['kernels_ms']} ms; decode step"
                f" {decode['graph_plus_head_ms']} ms + chunk FLOPs = {ideal_ms:.2f} ms ->"
                f" {mixed['ratio_to_ideal']}x (goal <= 1.5x)",
                flush=True,
            )
    # what the engine's first step of the 64-request run does; then ShareGPT-like: 256 decodes
    # beside 24 prompts of as many lengths (100..376 tokens), with and without the packed group
    many = mixed_feeds(worker, 0)[:DECODES]
    first_page = max(page for seq, _ in many for page in seq.block_table) + 1
    many += prefill_feeds(worker, [100 + 12 * i for i in range(24)], first_page)
    shapes = {
        f"prefill_64x{PROMPT_LEN}": (prefill_feeds(worker, [PROMPT_LEN] * 64), "packed"),
        "256_decodes_24_prompts": (many, "packed"),
        "256_decodes_24_prompts_unpacked": (many, "unpacked"),
    }
    for name, (feeds, mode) in shapes.items():
        tokens = sum(len(tokens) for seq, tokens in feeds if len(tokens) > 1)
        step = timed_step(worker, feeds, options.iters, mode)
        flops_ms = tokens * flops_per_token / rate * 1e3
        decodes = len(feeds) - sum(1 for _, tokens in feeds if len(tokens) > 1)
        ideal = flops_ms + (decode["graph_plus_head_ms"] if decodes == DECODES else 0.0)
        step |= {"prompt_tokens": tokens, "ideal_ms": round(ideal, 3)}
        step["ratio_to_ideal"] = round(step["step_ms"] / ideal, 3)
        report[name] = step
        print(f"{name}: {step['step_ms']} ms, kernels {step['kernels_ms']} ms, ideal {ideal:.2f}")

    clock = StepClock(engine)
    vocab = model_cfg.vocab_size
    run_throughput(engine, clock, 8, vocab)  # warm the serving loop
    for batch in (64, 256):
        runs = [run_throughput(engine, clock, batch, vocab, run) for run in range(options.repeats)]
        rates = [r["tok_per_s"] for r in runs]
        ideal = ideal_run(batch, model_cfg, weight_bytes, bandwidth, rate)
        measured = statistics.median(rates)
        steps = [
            {k: round(v * 1e3, 2) if k != "batch" else v for k, v in r.items()}
            for r in clock.records
        ]
        records = clock.records  # the last run's steps
        full = [r["total"] for r in records if r["batch"] == batch]
        report[f"concurrent_{batch}"] = {
            "last_run_decode_steps_s": round(sum(full), 4),
            "last_run_other_steps_s": round(sum(r["total"] for r in records) - sum(full), 4),
            "runs_tok_per_s": rates,
            "median_tok_per_s": measured,
            "ideal": ideal,
            "of_ideal": round(measured / ideal["tok_per_s"], 3),
            "last_run": runs[-1],
            "last_run_steps_ms": steps,
        }
        print(
            f"{batch} concurrent: {rates} tok/s, ideal {ideal['tok_per_s']} ->"
            f" {measured / ideal['tok_per_s']:.1%} (goal >= 85%)",
            flush=True,
        )
    report["arrivals"] = arrivals_run(engine, clock, vocab, 192, 4, 40)
    print(f"mixed steps in serving: {report['arrivals']}", flush=True)
    clock.close()
    engine.shutdown()
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "bench_mixed.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
