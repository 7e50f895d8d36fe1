"""Decode step time of SmolLM2 on CPU with and without a CPU-burning neighbour.

Each setting (thread count, OpenMP wait policy) runs in a fresh process, because the wait policy
is read once, when torch's OpenMP runtime loads.  The child serves batch 1, then batch 8, and
times N decode steps of each; the parent runs every setting alone and then beside a neighbour
(busy loops in `--burners` processes), and prints the medians and the ratios.

    python benchmarks/bench_contention.py [--steps 12] [--burners 2]
        [--settings old new 1:active 2:passive ...]

A setting is `old` (torch's default thread count, wait policy unset: memstep before the thread
policy), `new` (what the engine does now when nothing is set), or `THREADS:POLICY` with POLICY
one of active, passive, unset, or spinN (policy unset, GOMP_SPINCOUNT=N: libgomp's idle threads
spin N rounds, then sleep).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BATCHES = (1, 8)
WARM_STEPS = 2


def child(setting: str, steps: int) -> dict[str, float]:
    """Runs in the child process: the median decode step time at each batch size."""
    import torch

    from memstep.core.config import EngineConfig
    from memstep.core.sampling_params import SamplingParams
    from memstep.executors.process.inprocess import local_engine

    threads = None if setting == "new" else torch.get_num_threads()  # torch's own default
    if ":" in setting:
        threads = int(setting.split(":")[0])
    cfg = EngineConfig(model="smollm2", max_num_seqs=max(BATCHES), num_threads=threads, seed=0)
    engine = local_engine(cfg)
    medians = {"threads": float(torch.get_num_threads())}
    for batch in BATCHES:
        params = SamplingParams(max_tokens=steps + WARM_STEPS + 4, temperature=0.8, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"Tell me a story about the number {i}.", params)
        for _ in range(1 + WARM_STEPS):  # the prefill, then a few decode steps
            engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        engine.run_until_idle()
        medians[f"batch {batch}"] = statistics.median(times)
    engine.shutdown()
    return medians


def child_env(setting: str) -> dict[str, str]:
    """The environment a setting's child starts with: only the wait policy differs."""
    dropped = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    if setting == "new":
        from memstep.executors.cpu.threads import executor_env

        return executor_env(env)
    policy = setting.split(":")[1] if ":" in setting else "unset"
    if policy.startswith("spin"):
        env["GOMP_SPINCOUNT"] = policy.removeprefix("spin")
    elif policy != "unset":
        env["OMP_WAIT_POLICY"] = policy.upper()
    return env


def run_child(setting: str, steps: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", setting, "--steps", str(steps)]
    out = subprocess.run(cmd, env=child_env(setting), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_burners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def measure(settings: list[str], steps: int, burners: int) -> dict[tuple[str, bool], dict]:
    results = {}
    for busy in (False, True):
        neighbours = start_burners(burners) if busy else []
        try:
            for setting in settings:
                results[setting, busy] = run_child(setting, steps)
                print(f"# {setting} busy={busy}: {results[setting, busy]}", file=sys.stderr)
        finally:
            for proc in neighbours:
                proc.kill()
                proc.wait()
    return results


def table(results: dict[tuple[str, bool], dict], settings: list[str], burners: int) -> str:
    head = (
        f"{'setting':<12}{'threads':>8}{'batch':>6}{'alone s':>10}{'busy s':>10}{'busy/alone':>11}"
    )
    lines = [head, "-" * len(head)]
    old = results.get(("old", True))
    for setting in settings:
        for batch in BATCHES:
            key = f"batch {batch}"
            alone, busy = results[setting, False][key], results[setting, True][key]
            threads = int(results[setting, False]["threads"])
            row = f"{setting:<12}{threads:>8}{batch:>6}{alone:>10.4f}{busy:>10.4f}"
            lines.append(row + f"{busy / alone:>10.1f}x")
    if old is not None and ("new", True) in results:
        for batch in BATCHES:
            key = f"batch {batch}"
            gain = old[key] / results["new", True][key]
            lines.append(f"busy, batch {batch}: old / new = {gain:.1f}x")
    lines.append(f"(neighbour: {burners} busy-loop processes on {os.cpu_count()} CPUs)")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per batch size")
    p.add_argument("--burners", type=int, default=2, help="busy-loop neighbour processes")
    p.add_argument("--settings", nargs="+", default=["old", "new"])
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    results = measure(args.settings, args.steps, args.burners)
    print(table(results, args.settings, args.burners))


if __name__ == "__main__":
    main()
