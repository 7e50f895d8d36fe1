"""Soak: many clients sending ShareGPT chat prompts to `memstep serve` for a fixed time, then
whether each process's host memory stayed inside the soak's bound, with no leak report.

`memstep serve` runs in its own process (its executor in another, the HTTP front in a third) and
records its event log; `memstep bench serve --backend openai-chat` rounds of requests from
`--clients` concurrent chat clients (ShareGPT's first turns, vLLM's sample; replies capped at
`--max-output-len`) run one after another until the time is up (the last round is finished).
From the log's per-step memory reports: the core's and the executor's resident bytes after the
first served step, at their peak and at the end, their growth against `SOAK_BOUND_MIB` (the
soak's own bound: the detector judges a slope, not a size), live tensor bytes for contrast, and
the leak reports (high-water marks left out: information).  It passes with every process's
growth inside the bound and no report.

    python benchmarks/bench_soak.py --minutes 5 [--clients 64] [--model smollm2]
        [--max-num-seqs 16] [--max-output-len 32] [--num-threads 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0, help="load time (default 5)")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    p.add_argument("--prompts-per-round", type=int, help="default: 4 x clients")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench_soak_out"))
    return p.parse_args(argv)


def memstep(*args: str) -> list[str]:
    return [sys.executable, "-m", "memstep.cli.main", *args]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, dict[str, Any], Path]:
    ready, log = args.out / "ready.json", args.out / "soak.memlog"
    ready.unlink(missing_ok=True)
    flags = ["--model", args.model, "--zmq-port", "0", "--port", "0", "--ready-file", str(ready)]
    flags += ["--record", str(log), "--max-num-seqs", str(args.max_num_seqs)]
    flags += ["--num-threads", str(args.num_threads), "--log-format", "json"]
    with (args.out / "serve.log").open("w") as out:
        proc = subprocess.Popen(memstep("serve", *flags), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"memstep serve did not start; see {args.out / 'serve.log'}")
        time.sleep(0.5)
    return proc, json.loads(ready.read_text()), log


def load_rounds(args: argparse.Namespace, url: str) -> list[dict[str, Any]]:
    """Rounds of `--clients` concurrent chat requests until the time is up."""
    rounds: list[dict[str, Any]] = []
    end = time.monotonic() + args.minutes * 60
    while time.monotonic() < end:
        n = len(rounds)
        result = args.out / f"round{n}.json"
        cmd = memstep(
            "bench",
            "serve",
            "--backend",
            "openai-chat",
            "--base-url",
            url,
            "--model",
            args.model,
            "--dataset",
            "sharegpt",
            "--sample-seed",
            str(n),
            "--num-prompts",
            str(args.prompts_per_round or 4 * args.clients),
            "--max-concurrency",
            str(args.clients),
            "--max-output-len",
            str(args.max_output_len),
            "--disable-tqdm",
            "--json",
            str(result),
        )
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"bench serve round {n} failed: {done.stderr.strip()[-400:]}")
        metrics = json.loads(result.read_text())
        keys = ("completed", "failed", "output_throughput", "duration_s")
        rounds.append({k: metrics.get(k) for k in keys})
        print(f"round {n}: {rounds[-1]}", flush=True)
    return rounds


SOAK_BOUND_MIB = 64  # host growth a soak may show past its first served step


def verdict(log: Path, tolerance_mib: int) -> dict[str, Any]:
    from memstep.events.types import StepFinished, is_leak
    from memstep.replay.recording import load

    records = load(log).records
    mems = [r.memory for r in records if isinstance(r, StepFinished)]
    out: dict[str, Any] = {"num_steps": len(mems), "tolerance_mib": tolerance_mib}
    for process in ("executor", "core"):
        rss = [getattr(m, f"{process}_rss_bytes") for m in mems]
        out[process] = {
            "rss_first_mib": round(rss[0] / MIB, 1),
            "rss_peak_mib": round(max(rss) / MIB, 1),
            "rss_final_mib": round(rss[-1] / MIB, 1),
            "growth_mib": round((rss[-1] - rss[0]) / MIB, 1),
            "peak_growth_mib": round((max(rss) - rss[0]) / MIB, 1),
        }
    out["live_growth_bytes"] = mems[-1].live_bytes - mems[0].live_bytes
    leaks = [r for r in records if is_leak(r)]
    out["leak_reports"] = [f"step {x.step} {x.kind} {x.what}: {x.detail}" for x in leaks]
    inside = all(out[p]["peak_growth_mib"] <= tolerance_mib for p in ("executor", "core"))
    out["passed"] = inside and not leaks
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    proc, info, log = start_server(args)
    started = time.monotonic()
    try:
        rounds = load_rounds(args, info["http_url"])
    finally:
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    report = verdict(log, SOAK_BOUND_MIB)
    report |= {"minutes": round((time.monotonic() - started) / 60, 2), "rounds": rounds}
    report["requests"] = sum(r["completed"] or 0 for r in rounds)
    (args.out / "soak.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
