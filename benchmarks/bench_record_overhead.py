"""Recording overhead: the same offline workload with and without the event log.

One engine in one process serves the same batch of requests again and again, alternating runs
without and with a `Recorder` in its sinks (so drift in machine load hits both alike), and the
medians are compared.  Also reported: the time spent inside the recorder itself, measured per
call, which is the overhead without the noise of the machine.

    python benchmarks/bench_record_overhead.py [--model smollm2] [--requests 64] [--max-tokens 32]
        [--repeats 5] [--num-threads N] [--device auto] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

from memstep.core.config import EngineConfig, parse_override
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import EngineStarted
from memstep.events.version import VERSION
from memstep.executors.process.inprocess import local_engine
from memstep.replay.recorder import Recorder


class TimedRecorder(Recorder):
    """A recorder that also adds up the time spent in it."""

    seconds = 0.0

    def __call__(self, rec: object) -> None:
        start = time.perf_counter()
        super().__call__(rec)
        self.seconds += time.perf_counter() - start


def workload(engine: Engine, num: int, max_tokens: int) -> tuple[list, list]:
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(16 + i % 48)] for i in range(num)]
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
        for i in range(num)
    ]
    return prompts, params


def timed_run(engine: Engine, prompts: list, params: list, recorder: Recorder | None) -> float:
    if recorder is not None:
        recorder(EngineStarted(VERSION, engine.cfg.to_dict(), engine.source.identity))
        engine.sinks.append(recorder)
    gc.collect()
    start = time.perf_counter()
    engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    if recorder is not None:
        engine.sinks.remove(recorder)
        recorder.close()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="auto")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    cfg = EngineConfig(model=args.model, device=args.device, num_threads=args.num_threads)
    cfg = cfg.replace(**dict(parse_override(text) for text in args.overrides))
    engine = local_engine(cfg)
    prompts, params = workload(engine, args.requests, args.max_tokens)
    tokens = args.requests * args.max_tokens
    timed_run(engine, prompts, params, None)  # warm-up
    plain: list[float] = []
    recorded: list[float] = []
    inside: list[float] = []
    steps_before = engine.step_no
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            plain.append(timed_run(engine, prompts, params, None))
            recorder = TimedRecorder(Path(tmp) / f"run{i}.memlog")
            recorded.append(timed_run(engine, prompts, params, recorder))
            inside.append(recorder.seconds)
            log_bytes = sum(part.stat().st_size for part in recorder.parts)
    steps = (engine.step_no - steps_before) // (2 * args.repeats)
    engine.shutdown()
    off, on = statistics.median(plain), statistics.median(recorded)
    device = engine.executor.worker.device
    print(f"model {engine.source.label} on {device}")
    print(f"{args.requests} requests x {args.max_tokens} tokens, {steps} steps a run, ", end="")
    print(f"{args.repeats} runs each way, alternating")
    print(f"without recording: {tokens / off:10.1f} tokens/s (median {off:.3f} s)")
    print(f"with recording:    {tokens / on:10.1f} tokens/s (median {on:.3f} s)")
    overhead = 100 * (on / off - 1)
    print(f"throughput ratio (with / without): {off / on:.4f}, overhead {overhead:+.2f}%")
    in_rec = statistics.median(inside)
    print(
        f"time inside the recorder: {in_rec * 1e3:.1f} ms a run, {in_rec / steps * 1e6:.0f} us a "
        f"step = {100 * in_rec / on:.2f}% of the run; log {log_bytes / 1024:.0f} KiB a run"
    )


if __name__ == "__main__":
    main()
