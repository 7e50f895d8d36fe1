"""Engine-core host time per step with about a thousand running decodes (issue #15).

An in-process engine with the smallest random model keeps `--requests` requests decoding (short
prompts, EOS ignored, long outputs).  Each step's wall time is split into the time inside
`executor.execute` and the rest, the core's own work (schedule, plan, record, detokenize, emit);
the medians over `--steps` steady-state steps are printed, with the core thread's CPU time
(steadier than wall time on a shared machine), and the codec's time for the last step's plan
and result (which a process executor encodes and decodes each step).  The collector's threshold
is the core process's (core/collector.py) unless `--default-gc`.  `--record`
adds an event-log `Recorder` to the sinks; `--profile N` prints the N costliest functions of
the core's steps. `--process` runs the executor in a process of its own, as `memstep serve`
does: the executor's figure is then its round trip (the codec, the socket and its own work).
The executor runs on one CPU thread by default, so that its thread pool does not compete with the
core on a small machine (the core's time, not the model's, is measured).

    python benchmarks/bench_core_overhead.py [--requests 1000] [--steps 50] [--warmup 5]
        [--record] [--profile 25] [--num-threads 1] [--process] [--set KEY=VALUE ...]
        [--log-level warning] [--default-gc]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path

from memstep.core import collector
from memstep.core.config import EngineConfig, parse_override
from memstep.core.engine import Engine
from memstep.core.logging import setup_logging
from memstep.core.sampling_params import SamplingParams
from memstep.events import codec
from memstep.events.types import EngineStarted
from memstep.events.version import VERSION
from memstep.executors.process.inprocess import local_engine
from memstep.executors.process.remote import ProcessExecutor
from memstep.replay.recorder import Recorder


class TimedExecutor:
    """Wraps an executor: adds up the time spent in `execute` (wall and this thread's CPU),
    which `profiler` does not see."""

    def __init__(self, inner: object):
        self.inner = inner
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.profiler: cProfile.Profile | None = None
        self.last: tuple[object, object] | None = None  # the last plan and its result

    def execute(self, plan: object) -> object:
        if self.profiler is not None:
            self.profiler.disable()
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            result = self.inner.execute(plan)  # type: ignore[attr-defined]
            self.last = (plan, result)
            return result
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu
            if self.profiler is not None:
                self.profiler.enable()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5, help="decode steps before measuring")
    p.add_argument("--record", action="store_true", help="write the event log while stepping")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print N top functions")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument(
        "--process",
        action="store_true",
        help="the executor in its own process, as served: `executor` is then the round trip",
    )
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--log-level", default="warning", help="as `memstep serve`'s (its default)")
    p.add_argument(
        "--default-gc", action="store_true", help="Python's collector threshold, not the core's"
    )
    args = p.parse_args()
    setup_logging("console", args.log_level)
    if not args.default_gc:
        collector.tune_for_core()
    max_tokens = args.warmup + args.steps + 16  # nobody finishes while measured
    cfg = EngineConfig(
        model="random:tiny",
        device="cpu",
        max_num_seqs=1024,
        max_num_batched_tokens=16384,
        num_kv_blocks=args.requests * (max_tokens // 16 + 2),
        num_threads=args.num_threads,
    )
    cfg = cfg.replace(**dict(parse_override(text) for text in args.overrides))
    engine = Engine(cfg, ProcessExecutor) if args.process else local_engine(cfg)
    engine.executor = timed = TimedExecutor(engine.executor)
    with tempfile.TemporaryDirectory() as tmp:
        if args.record:
            recorder = Recorder(Path(tmp) / "core.memlog")
            recorder(EngineStarted(VERSION, engine.cfg.to_dict(), engine.source.identity))
            engine.sinks.append(recorder)
        for i in range(args.requests):
            prompt = [(7 * i + j) % 250 + 10 for j in range(4 + i % 5)]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True)
            engine.add_request(prompt, params)
        for _ in range(1 + args.warmup):  # the prefill, then a few decodes
            engine.step()
        profiler = cProfile.Profile()
        totals, inside, cpus, cpus_inside = [], [], [], []
        for _ in range(args.steps):
            timed.seconds = timed.cpu_seconds = 0.0
            if args.profile:
                timed.profiler = profiler
                profiler.enable()
            start, cpu = time.perf_counter(), time.thread_time()
            engine.step()
            totals.append(time.perf_counter() - start)
            cpus.append(time.thread_time() - cpu)
            profiler.disable()
            timed.profiler = None
            inside.append(timed.seconds)
            cpus_inside.append(timed.cpu_seconds)
        running = len(engine.scheduler.running)
        engine.shutdown()
        if args.record:
            recorder.close()
    cores = [t - x for t, x in zip(totals, inside, strict=True)]
    med = statistics.median
    where = "its own process" if args.process else "this process"
    print(f"model {engine.source.label}, {running} running decodes, {args.steps} steps", end="")
    print(f", the executor in {where}", end="")
    print(", recording" if args.record else "")
    print(f"step total    median {1e3 * med(totals):8.2f} ms")
    print(f"executor      median {1e3 * med(inside):8.2f} ms")
    print(f"core (rest)   median {1e3 * med(cores):8.2f} ms  (min {1e3 * min(cores):.2f} ms)")
    own = [c - x for c, x in zip(cpus, cpus_inside, strict=True)]
    print(
        f"core CPU      median {1e3 * med(own):8.2f} ms  (this thread, outside `execute`; "
        f"{1e3 * med(cpus):.2f} ms with it: a process executor's codec and socket)"
    )
    assert timed.last is not None
    for name, rec in zip(("plan", "result"), timed.last, strict=True):
        data = codec.encode(rec)
        enc = med(timed_call(lambda rec=rec: codec.encode(rec)))
        dec = med(timed_call(lambda data=data: codec.decode(data)))
        print(
            f"codec {name:<7} {len(data) / 1e3:8.1f} kB  encode {1e3 * enc:.2f} ms, "
            f"decode {1e3 * dec:.2f} ms  (a process executor pays both each step)"
        )
    if args.profile:
        stats = pstats.Stats(profiler).strip_dirs().sort_stats("tottime")
        stats.print_stats(args.profile)


def timed_call(fn, times: int = 20) -> list[float]:
    seconds = []
    for _ in range(times):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


if __name__ == "__main__":
    main()
