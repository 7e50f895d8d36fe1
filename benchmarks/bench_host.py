"""Where a serving step's time goes with many requests running: the engine core's and the
executor's host work beside the device's.

One engine in this process (its executor in-process, so each part can be timed): `--running`
requests of 20-250 random prompt tokens decode while `--new` short ones arrive every step (so
every step is a mixed step while there is room, a decode step once `max_num_seqs` is full).
Prints the median of each part over `--steps` steps: the core's planning (`core_plan`, its
scheduler `core_schedule`) and recording (`core_record`), the executor's batch building, model
forward (host time: the device runs on), sampling rows and memory measurement, the executor's
whole call, and the step. On CUDA, also the device's kernel time a step (torch profiler, three
steps): what the step would take if the host never made the device wait.

    python benchmarks/bench_host.py [--model random:llama-3.1-8b] [--running 900] [--new 3]
        [--steps 40] [--max-num-seqs 1024] [--max-num-batched-tokens 8192]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics

import torch
from common import StepClock

# what a step's parts print as: StepClock's own parts, then those this script times
LABELS = {
    "core_plan": "core_plan",
    "core_schedule": "core_schedule",
    "build_batch": "build_batch",
    "forward": "forward_host",
    "sample_rows": "sample_rows",
    "sampler": "sampler",
    "memory_measure": "memory_measure",
    "worker_execute": "worker_execute",
    "executor_execute": "executor",
    "core_record": "core_record",
    "total": "step",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--running", type=int, default=900)
    ap.add_argument("--new", type=int, default=3, help="new requests a step")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=None)
    args = ap.parse_args()
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    import memstep.executors.runtime.runner as runner_module
    from memstep.core.config import EngineConfig
    from memstep.core.sampling_params import SamplingParams
    from memstep.executors.process.inprocess import local_engine

    cuda = torch.cuda.is_available()
    cfg = EngineConfig(
        model=args.model,
        dtype="bfloat16" if cuda else "float32",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    if args.max_model_len:
        cfg = cfg.replace(max_model_len=args.max_model_len)
    engine = local_engine(cfg)
    worker = engine.executor.worker
    clock = StepClock(engine)  # the executor's call, its worker's, the forward, the sampler
    clock.wrap(engine, "_next_plan", "core_plan")
    clock.wrap(engine.scheduler, "schedule", "core_schedule")
    clock.wrap(engine, "_record", "core_record")
    clock.wrap(worker, "sample_rows")
    clock.wrap(worker, "_measure", "memory_measure")
    clock.wrap(runner_module, "build_batch")

    rng = random.Random(0)
    vocab = worker.model_cfg.vocab_size

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(3, vocab) for _ in range(rng.randrange(20, 250))] for _ in range(n)]

    long = SamplingParams(temperature=0.0, max_tokens=args.steps + 200, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for prompt in prompts(args.running):
        engine.add_request(prompt, long)
    for _ in range(200):  # until every one of them is admitted
        if len(engine.scheduler.running) >= args.running and not engine.scheduler.waiting:
            break
        engine.step()

    def step() -> None:
        for prompt in prompts(args.new):
            engine.add_request(prompt, short)
        clock.step()

    for _ in range(5):
        step()
    clock.records.clear()
    for _ in range(args.steps):
        step()
    running = statistics.median(r["batch"] for r in clock.records)
    print(f"{args.model}: {running:.0f} running, {args.new} new a step")
    for key, label in LABELS.items():
        ms = statistics.median(r.get(key, 0.0) for r in clock.records) * 1e3
        print(f"  {label:16s} {ms:8.2f} ms")
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
        kernels = sum(e.self_device_time_total for e in prof.key_averages()) / 3 / 1e3
        print(f"  {'device kernels':16s} {kernels:8.2f} ms a step")
    engine.shutdown()


if __name__ == "__main__":
    main()
