"""Every family fast on CUDA (issue 56, Must show 4): Qwen3 and a mixture of experts beside Llama,
on one GPU, in one call of at most ten minutes.

For `random:llama-3.1-8b`, `random:qwen3-8b` and `random:qwen3-30b-a3b` in bf16, each in a
process of its own (a 30B model leaves no room for a second):

1. The decode step (graph replay + head, as bench_gpu.py times Llama's) at 64 and 256 rows at
   the benchmarks' context, each row a different token, against its roof: a dense model's is
   the weight-read roof (every weight but the embedding table at the device's copy bandwidth)
   or the compute roof where larger, as bench_gpu.py's; a mixture of experts' is the read of
   what that step actually reads: every weight but the experts', plus, layer by layer, the
   distinct experts its rows route to (counted in an eager run of the same step). Printed as
   `of_roof` = roof / step (issue 56 asks >= 0.75 of the dense roof).
2. The seed's experiment, `bench_sharegpt.py` (`memstep serve`, then `memstep bench serve
   --dataset sharegpt`: vLLM's sample, `--ignore-eos`) at the seed's 60 req/s, but with
   `--num-prompts` (default 600) instead of the seed's 7,200 and `--engine-flags` (default 512
   sequences, 2,048 tokens a step) so that three servers start and drain within the call: TTFT,
   TPOT, output tok/s, the KV pages the memory plan gave and the most in use.

    python benchmarks/bench_families.py --out DIR --tokenizer T --dataset F.jsonl
        [--num-prompts 600] [--models a,b,c] [--parts roof,serve] [--budget 570]

Results go to DIR (roof.<model>.json, serve_<model>/, families.json, families.txt); a part that
would start past `--budget` seconds is left out and said so.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import CONTEXT, copy_bandwidth, matmul_rate, median_ms

MODELS = ("random:llama-3.1-8b", "random:qwen3-8b", "random:qwen3-30b-a3b")
ROWS = (64, 256)
SERVE_FLAGS = "--max-num-seqs 512 --max-num-batched-tokens 2048"
ROOF_SECONDS, SERVE_SECONDS = 90, 150  # what a part is given before the budget runs out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench_families_out"))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--parts", default="roof,serve", help="roof, serve or both")
    p.add_argument("--tokenizer", type=Path, help="tokenizer.json (bench_sharegpt's)")
    p.add_argument("--dataset", default="sharegpt", help="sharegpt or an exported JSONL file")
    p.add_argument("--num-prompts", type=int, default=600)
    p.add_argument("--request-rate", type=float, default=60.0)
    p.add_argument("--engine-flags", default=SERVE_FLAGS)
    p.add_argument("--budget", type=float, default=570.0, help="seconds for the whole run")
    p.add_argument("--roof-of", help=argparse.SUPPRESS)  # one model's roof, in its own process
    return p.parse_args(argv)


def label(model: str) -> str:
    return model.removeprefix("random:")


# --- the decode step against its roof (one model, in this process) ------------------------------


def distinct_feeds(batch: int, context: int, block_size: int, vocab: int):
    """`batch` decodes at `context`, each its own pages and its own token (rows alike would all
    route to the same experts)."""
    from memstep.core.shapes import cdiv
    from memstep.events.plan import SeqPlan

    pages = cdiv(context + 1, block_size)
    feeds = []
    for i in range(batch):
        token = (7919 * i + 11) % (vocab - 3) + 3
        table = list(range(i * pages, (i + 1) * pages))
        feeds.append((SeqPlan(f"b{i}", context, [token], table, True, 0, 0, {}), [token]))
    return feeds


def experts_read(worker, size: int) -> list[int]:
    """Each expert layer's distinct experts over the filled decode rows, from an eager run of
    the decode forward with the fused MoE counting them."""
    from memstep.executors.cuda import kernels
    from memstep.executors.cuda.kernels.fused_moe import experts_hit

    hits: list[int] = []
    fused = kernels.fused_moe

    def counting(x, experts, activation):
        hits.append(experts_hit(x, experts))
        return fused(x, experts, activation)

    kernels.fused_moe = counting  # the backend looks it up at each call
    try:
        worker.graphs.decode(size)
    finally:
        kernels.fused_moe = fused
    return hits


def step_ms(worker, batch: int) -> tuple[float, list[int]]:
    """The decode step (graph replay + head) at `batch` distinct rows; the experts it reads."""
    runner, cfg = worker.graphs, worker.model_cfg
    runner.drop_ahead()  # replays here overwrite the decode buffers
    size = runner.padded_size(batch)
    with torch.inference_mode():
        feeds = distinct_feeds(batch, CONTEXT, worker.cfg.block_size, cfg.vocab_size)
        runner.inputs.fill(feeds, size)
        hits = experts_read(worker, size) if cfg.is_moe else []
        graph, hidden = runner.graphs[size], runner.decode.hidden[:batch]
        ms = median_ms(lambda: (graph.replay(), worker.model.logits(hidden)), 50, warmup=3)
    return ms, hits


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def roof_of(model: str) -> dict[str, Any]:
    """One model's decode steps against their roofs (the device's ceilings measured first,
    before the engine takes the memory)."""
    from memstep.core.config import EngineConfig
    from memstep.executors.process.inprocess import local_engine

    bandwidth, rate = copy_bandwidth(), matmul_rate()
    torch.cuda.empty_cache()
    limits = {"max_num_seqs": max(ROWS), "max_num_batched_tokens": 1024}
    graphs = {"piecewise_graphs": False, "decode_ahead": False}  # the decode graphs alone
    cfg = EngineConfig(model=model, dtype="bfloat16", **limits, **graphs)
    start = time.perf_counter()
    engine = local_engine(cfg)
    worker = engine.executor.worker
    w, mc = worker.weights, worker.model_cfg
    total = sum(nbytes(t) for t in w.values())
    read = total - (nbytes(w["embed"]) if "lm_head" in w else 0)  # a tied table is the head
    experts = [n for n in w if n.endswith(("experts_gate_up", "experts_down"))]
    expert_bytes = sum(nbytes(w[n]) for n in experts)
    one_expert = expert_bytes // max(1, mc.num_layers * mc.num_experts)
    report: dict[str, Any] = {
        "model": f"{model} bf16",
        "device": torch.cuda.get_device_name(),
        "start_seconds": round(time.perf_counter() - start, 1),
        "copy_bw_tb_s": round(bandwidth / 1e12, 3),
        "matmul_tflops": round(rate / 1e12, 1),
        "weight_bytes_read": read,
        "num_kv_blocks": engine.memory_plan.num_kv_blocks,
        "steps": {},
    }
    # a row multiplies every weight but the experts', and its k experts of each layer
    active = read - expert_bytes + mc.experts_per_token * mc.num_layers * one_expert
    for batch in ROWS:
        ms, hits = step_ms(worker, batch)
        step_read = read - expert_bytes + sum(hits) * one_expert
        weight_ms = step_read / bandwidth * 1e3
        compute_ms = active * batch / rate * 1e3  # 2 FLOPs a bf16 parameter (2 bytes) a row
        roof = max(weight_ms, compute_ms)
        report["steps"][batch] = {
            "step_ms": round(ms, 3),
            "bytes_read": step_read,
            "weight_roof_ms": round(weight_ms, 3),
            "compute_roof_ms": round(compute_ms, 3),
            "of_roof": round(roof / ms, 3),
        }
        if mc.is_moe:
            report["steps"][batch] |= {
                "experts_hit_mean": round(sum(hits) / len(hits), 1),
                "experts_per_layer": mc.num_experts,
                "of_all_experts_roof": round(read / bandwidth * 1e3 / ms, 3),
            }
    engine.shutdown()
    return report


# --- the driver -----------------------------------------------------------------------------


def run_roof(model: str, out: Path) -> dict[str, Any] | None:
    path, log = out / f"roof.{label(model)}.json", out / f"roof.{label(model)}.log"
    cmd = [sys.executable, __file__, "--roof-of", model, "--out", str(out)]
    with log.open("w") as sink:
        try:
            code = subprocess.run(
                cmd, stdout=sink, stderr=subprocess.STDOUT, timeout=240
            ).returncode
        except subprocess.TimeoutExpired:
            code = -1
    if code != 0 or not path.is_file():
        print(f"[{label(model)}] roof failed ({code}):\n{log.read_text()[-3000:]}")
        return None
    return json.loads(path.read_text())


def run_serve(model: str, args: argparse.Namespace) -> dict[str, Any] | None:
    out = args.out / f"serve_{label(model)}"
    cmd = [sys.executable, str(Path(__file__).with_name("bench_sharegpt.py")), "--out", str(out)]
    cmd += ["--model", model, "--configs", "default", "--dataset", args.dataset]
    cmd += ["--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate)]
    cmd += ["--engine-flags", args.engine_flags, "--timeout", "120"]
    if args.tokenizer is not None:
        cmd += ["--tokenizer", str(args.tokenizer)]
    subprocess.run(cmd)  # its memory verdict's exit status is not this benchmark's
    result = out / "default.result.json"
    if not result.is_file():
        print(f"[{label(model)}] serve left no result")
        return None
    data = json.loads(result.read_text())
    bench, memory = data["bench"], data["memory"]
    keys = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms")
    figures = {k: round(bench[k], 1) for k in keys}
    return figures | {
        "output_tok_s": round(bench["output_throughput"], 1),
        "completed": bench["completed"],
        "kv_pages": memory["num_kv_blocks"],
        "kv_pages_peak_used": memory["kv_pages_peak"],
        "kv_pages_left_at_peak": memory["num_kv_blocks"] - memory["kv_pages_peak"],
        "memory_flat": memory["flat"],
    }


def table(results: dict[str, dict[str, Any]], num_prompts: int, rate: float) -> str:
    lines = ["decode step against its roof (graph + head, distinct rows, context 192)"]
    lines.append(f"{'model':<16} {'rows':>4} {'step ms':>8} {'roof ms':>8} {'of roof':>8}  notes")
    for name, r in results.items():
        for batch, s in (r.get("roof") or {}).get("steps", {}).items():
            roof = max(s["weight_roof_ms"], s["compute_roof_ms"])
            note = ""
            if "experts_hit_mean" in s:
                note = (
                    f"experts read {s['experts_hit_mean']}/{s['experts_per_layer']} a layer; "
                    f"of the all-experts roof {s['of_all_experts_roof']}"
                )
            lines.append(
                f"{name:<16} {batch:>4} {s['step_ms']:>8} {round(roof, 3):>8} "
                f"{s['of_roof']:>8}  {note}"
            )
    lines.append(f"\nseed experiment, {num_prompts} ShareGPT prompts (not 7,200) at {rate:g} req/s")
    head = f"{'model':<16} {'TTFT mean/med/p99 ms':>22} {'TPOT mean ms':>13} {'out tok/s':>10}"
    lines.append(f"{head} {'KV pages (peak used)':>22} flat")
    for name, r in results.items():
        s = r.get("serve")
        if not s:
            continue
        ttft = f"{s['mean_ttft_ms']}/{s['median_ttft_ms']}/{s['p99_ttft_ms']}"
        pages = f"{s['kv_pages']} ({s['kv_pages_peak_used']})"
        lines.append(
            f"{name:<16} {ttft:>22} {s['mean_tpot_ms']:>13} {s['output_tok_s']:>10} "
            f"{pages:>22} {s['memory_flat']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.roof_of:
        import structlog

        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
        report = roof_of(args.roof_of)
        (args.out / f"roof.{label(args.roof_of)}.json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))
        return 0
    start, parts = time.monotonic(), args.parts.split(",")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    results: dict[str, dict[str, Any]] = {label(m): {} for m in models}
    plan = [(p, m) for p in ("roof", "serve") if p in parts for m in models]
    left: dict[str, list[str]] = {}
    for part, model in plan:
        elapsed = time.monotonic() - start
        need = ROOF_SECONDS if part == "roof" else SERVE_SECONDS
        if elapsed + need > args.budget:
            print(f"[{label(model)}] {part} left out: {elapsed:.0f} s of {args.budget:.0f} used")
            left.setdefault(part, []).append(model)
            continue
        print(f"[{label(model)}] {part} at {elapsed:.0f} s", flush=True)
        run = run_roof(model, args.out) if part == "roof" else run_serve(model, args)
        results[label(model)][part] = run
        (args.out / "families.json").write_text(json.dumps(results, indent=2))
    text = table(results, args.num_prompts, args.request_rate)
    for part, rest in left.items():  # what a next call should run
        text += f"\nleft out by the budget: MODELS={','.join(rest)} PARTS={part}"
    (args.out / "families.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
