"""memstep on a GPU against its rooflines and against Hugging Face transformers, in one run.

On random:llama-3.1-8b in bf16 (seeded random weights; both engines read the same weights):
the device's measured copy bandwidth and bf16 matmul rate, the weight-read and compute
rooflines of a decode step, memstep's decode step at batch 1 and 256, output tokens/s at 64 and
256 concurrent requests (128 prompt + 128 output tokens each) for memstep and for HF `generate`,
and a memory run of >= 2,000 requests with random sampling and rising concurrency after warm-up
and capture (allocator segments and reserved bytes before and after). Last, unless
`--no-fp8-kv`, the engine again with an fp8 KV cache: its pages, decode steps and throughput.

    python benchmarks/bench_gpu.py [--out DIR] [--skip-hf] [--memory-requests N] [--repeats 3]

Throughput runs `--repeats` times per size for each engine: the first run ("cold") pays
one-time costs (kernel plans and tuning for new shapes; Hugging Face's is several times slower
than its later runs), "warm" is the median of the runs after it.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from common import (
    CONTEXT,
    MODEL,
    OUTPUT_LEN,
    PROMPT_LEN,
    StepClock,
    copy_bandwidth,
    decode_feeds,
    kernel_profile,
    matmul_rate,
    median_ms,
    model_step_ms,
    random_prompts,
    run_throughput,
)

# --- ceilings ----------------------------------------------------------------------------------


def gemm_table(weights: dict, bandwidth: float, rate: float) -> list[dict]:
    """cuBLAS on each distinct weight shape of one layer (and the head) at M = 1 and 256."""
    rows = []
    for name in (
        "layers.0.wqkv",
        "layers.0.wo",
        "layers.0.w_gate_up",
        "layers.0.w_down",
        "lm_head",
    ):
        w = weights[name]
        for m in (1, 256):
            x = torch.randn(m, w.shape[1], device="cuda", dtype=w.dtype)
            ms = median_ms(lambda x=x, w=w: F.linear(x, w), 50, warmup=3)
            nbytes = w.numel() * w.element_size()
            rows.append(
                {
                    "weight": name,
                    "shape": list(w.shape),
                    "m": m,
                    "ms": round(ms, 4),
                    "weight_gb_per_s": round(nbytes / ms / 1e6, 1),
                    "of_copy_bw": round(nbytes / (ms / 1e3) / bandwidth, 3),
                    "tflops": round(2 * m * w.numel() / ms / 1e9, 1),
                    "of_matmul_rate": round(2 * m * w.numel() / (ms / 1e3) / rate, 3),
                }
            )
    return rows


# --- Hugging Face ------------------------------------------------------------------------------


def hf_generate_seconds(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    torch.cuda.synchronize()
    return time.perf_counter() - start


def cold_and_warm(rates: list[float]) -> dict:
    """The first run at a size (it pays one-time costs: kernel plans, tuning, allocations) and
    the median of the runs after it."""
    warm = statistics.median(rates[1:]) if len(rates) > 1 else None
    return {"cold_tok_per_s": rates[0], "warm_tok_per_s": warm, "runs_tok_per_s": rates}


def bench_hf(weights, model_cfg, vocab: int, repeats: int) -> dict:
    from memstep.executors.model.hf_reference import hf_llama

    model = hf_llama(weights, model_cfg)
    hf_generate_seconds(model, random_prompts(2, 16, vocab, 0), 4)  # warm-up
    one = random_prompts(1, PROMPT_LEN, vocab, 1)
    for _ in range(2):  # the second pass is warm: every length has been seen once
        t1 = hf_generate_seconds(model, one, 1)
        t33 = hf_generate_seconds(model, one, 33)
    result: dict = {"hf_step_ms_batch1": round((t33 - t1) / 32 * 1e3, 2)}
    for batch in (64, 256):
        prompts = random_prompts(batch, PROMPT_LEN, vocab, batch)
        runs = [hf_generate_seconds(model, prompts, OUTPUT_LEN) for _ in range(repeats)]
        rates = [round(batch * OUTPUT_LEN / t, 1) for t in runs]
        result[f"hf_{batch}"] = cold_and_warm(rates)
        print(f"HF generate batch {batch}: {rates} tok/s", flush=True)
    del model
    return result


# --- memstep -----------------------------------------------------------------------------------


def attention_sweep(worker) -> list[dict]:
    """Decode attention on layer 0's real cache at the benchmark's context, per tile config
    (module constants patched for the sweep) and split-K partition size; L2 flushed per run."""

    from memstep.executors.cuda.kernels import DecodeWorkspace, paged_decode_attention
    from memstep.executors.cuda.kernels import paged_attention as pa

    cfg = worker.model_cfg
    k_cache, v_cache = worker.kv[0]
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    saved = (pa._BLOCK_N, pa._NUM_WARPS, pa._NUM_STAGES)
    rows = []
    cases = [
        (256, (64, 4, 2)),
        (256, (64, 4, 3)),
        (256, (64, 8, 2)),
        (256, (64, 8, 3)),
        (256, (32, 4, 2)),
        (256, (32, 4, 3)),
        (256, (128, 8, 2)),
        (64, (64, 4, 2)),
        (64, (32, 4, 3)),
        (64, (64, 8, 3)),
    ]
    cases += [(1, (64, 4, 2)), (1, (32, 4, 2)), (1, (32, 4, 3))]
    try:
        for batch, (block_n, warps, stages) in cases:
            feeds = decode_feeds(batch, CONTEXT, worker.cfg.block_size)
            # full-width tables, as in the captured graphs
            tables = torch.zeros(batch, worker.graphs.inputs.max_blocks, dtype=torch.int32)
            for row, (seq, _) in zip(tables, feeds, strict=True):
                row[: len(seq.block_table)] = torch.tensor(seq.block_table)
            tables = tables.cuda()
            lens = torch.full((batch,), CONTEXT + 1, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, cfg.num_heads, cfg.head_dim, device="cuda", dtype=k_cache.dtype)
            out = torch.empty_like(q)
            pa._BLOCK_N, pa._NUM_WARPS, pa._NUM_STAGES = block_n, warps, stages
            for partition in (64, 128, 256) if batch == 1 else (256,):
                width = tables.shape[1] * worker.cfg.block_size
                ws = DecodeWorkspace.allocate(
                    batch, cfg.num_heads, cfg.head_dim, width, "cuda", partition
                )
                args = (q, k_cache, v_cache, tables, lens, 0.088, out, ws)
                ms = median_ms(lambda args=args: paged_decode_attention(*args), 30, flush)
                rows.append(
                    {
                        "batch": batch,
                        "block_n": block_n,
                        "warps": warps,
                        "stages": stages,
                        "partition": partition,
                        "us": round(ms * 1e3, 2),
                    }
                )
    finally:
        pa._BLOCK_N, pa._NUM_WARPS, pa._NUM_STAGES = saved
    return rows


@dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # bytes/s, device-to-device copy
    rate: float  # FLOP/s, bf16 matmul
    total_bytes: int  # every weight byte
    read_bytes: int  # the weight bytes a decode step reads (all but the embedding table)
    num_params: int


def step_table(worker, c: Ceilings, max_num_seqs: int) -> dict:
    """Decode step (graph + head) at the benchmark's context against the rooflines: ours
    (bytes a step reads, 2 x matmul parameters x batch) and the issue's (every weight byte,
    2 x all parameters x batch)."""
    weight_ms = c.read_bytes / c.bandwidth * 1e3
    issue_weight_ms = c.total_bytes / c.bandwidth * 1e3
    steps = {}
    for batch in (1, 8, 64, 256):
        if batch > max_num_seqs:
            continue
        figures = model_step_ms(worker, batch, CONTEXT)
        compute_ms = 2 * (c.read_bytes // 2) * batch / c.rate * 1e3
        issue_compute_ms = 2 * c.num_params * batch / c.rate * 1e3
        step_ms = figures["graph_plus_head_ms"]
        figures |= {
            "weight_roofline_ms": round(weight_ms, 3),
            "compute_roofline_ms": round(compute_ms, 3),
            "ratio_to_max_roofline": round(step_ms / max(weight_ms, compute_ms), 3),
            "issue_weight_roofline_ms": round(issue_weight_ms, 3),
            "issue_compute_roofline_ms": round(issue_compute_ms, 3),
            "issue_ratio": round(step_ms / max(issue_weight_ms, issue_compute_ms), 3),
        }
        steps[batch] = figures
    return steps


def step_floor(kernels: list[dict], step: dict, kv_bytes: int, bandwidth: float) -> dict:
    """The decode step if decode attention read its KV bytes at the copy bandwidth, every
    other kernel took what `kernel_profile` measured, no time passed between kernels, and the
    head took what it did (`step`, from `step_table`): how far kernel work outside attention
    lets the step come down."""
    is_attention = ("_decode_kernel", "_merge_partitions_kernel")
    attention = sum(r["ms_per_step"] for r in kernels if r["kernel"] in is_attention)
    others = sum(r["ms_per_step"] for r in kernels) - attention
    head = step["graph_plus_head_ms"] - step["graph_ms"]
    kv_ms = kv_bytes / bandwidth * 1e3
    floor = others + kv_ms + head
    roof = max(step["issue_weight_roofline_ms"], step["issue_compute_roofline_ms"])
    return {
        "kernels_but_attention_ms": round(others, 3),
        "attention_ms": round(attention, 3),
        "attention_at_copy_bandwidth_ms": round(kv_ms, 3),
        "head_ms": round(head, 3),
        "floor_ms": round(floor, 3),
        "issue_ratio_of_floor": round(floor / roof, 3),
    }


def fp8_kv_section(cfg, ceilings: Ceilings, vocab: int, bf16_blocks: int) -> dict:
    """The same engine with an fp8 KV cache: pages, decode steps and one throughput run per
    size (a different configuration from the issue's bf16 figures above)."""
    from memstep.events.plan import PhaseFigures
    from memstep.executors.cuda.graph_runner import peak_figures, with_peaks
    from memstep.executors.process.inprocess import local_engine

    torch.cuda.reset_peak_memory_stats()  # the bf16 engine's peak is not this one's
    engine = local_engine(cfg.replace(kv_cache_dtype="fp8"))
    worker = engine.executor.worker
    blocks = engine.memory_plan.num_kv_blocks
    result: dict = {"num_kv_blocks": blocks, "blocks_vs_bf16": round(blocks / bf16_blocks, 3)}
    result["peak_after_capture"] = peak_figures(
        with_peaks(PhaseFigures(), worker.device, worker.memory_plan)
    )
    result["decode_step"] = step_table(worker, ceilings, cfg.max_num_seqs)
    clock = StepClock(engine)
    run_throughput(engine, clock, 8, vocab)
    for batch in (64, 256):
        if batch <= cfg.max_num_seqs:
            result[f"memstep_{batch}_tok_per_s"] = run_throughput(engine, clock, batch, vocab)[
                "tok_per_s"
            ]
    clock.close()
    engine.shutdown()
    return result


def memory_run(engine, num_requests: int, max_concurrency: int) -> dict:
    """Waves of random-sampling requests growing 1, 2, 4, ... max_concurrency, half of each
    wave one step late (mixed steps)."""
    from memstep.cli.traffic import rising_waves

    start = time.perf_counter()
    steps = rising_waves(engine, num_requests, max_concurrency, seed=7)
    return {
        "requests": num_requests,
        "steps": steps,
        "seconds": round(time.perf_counter() - start, 1),
    }


def allocator() -> dict:
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    return {
        "segments": stats["segment.all.current"],
        "reserved_bytes": stats["reserved_bytes.all.current"],
        "allocated_bytes": stats["allocated_bytes.all.current"],
    }


# --- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--memory-requests", type=int, default=2000)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--repeats", type=int, default=3, help="throughput runs per size, both engines (median)"
    )
    parser.add_argument("--sweep", action="store_true", help="time decode-attention tile configs")
    parser.add_argument(
        "--no-fp8-kv", dest="fp8_kv", action="store_false", help="skip the fp8 KV cache section"
    )
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu needs a CUDA device")
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from memstep.core.config import EngineConfig
    from memstep.core.model_source import model_config, resolve
    from memstep.events.plan import PhaseFigures
    from memstep.events.types import is_leak
    from memstep.executors.cuda.graph_runner import peak_figures, with_peaks
    from memstep.executors.model.weights import load_weights
    from memstep.executors.process.inprocess import local_engine

    report: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": f"{MODEL} (seeded random weights, seed=0), bf16",
    }
    bandwidth, rate = copy_bandwidth(), matmul_rate()
    report |= {"copy_bw_tb_s": round(bandwidth / 1e12, 3), "matmul_tflops": round(rate / 1e12, 1)}
    print(f"copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)

    source = resolve(MODEL, 0)
    model_cfg = model_config(source)
    vocab = model_cfg.vocab_size
    weights = load_weights(source, model_cfg, torch.bfloat16, torch.device("cuda"))
    total_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    # a decode step reads every weight but the embedding table (it gathers `batch` rows of it)
    read_bytes = total_bytes - weights["embed"].numel() * weights["embed"].element_size()
    report |= {"weight_bytes": total_bytes, "weight_bytes_read_per_step": read_bytes}
    report["gemms"] = gemm_table(weights, bandwidth, rate)
    save(report, options.out)
    if not options.skip_hf:
        repeats = options.repeats
        attempt(report, "hf", lambda: report.update(bench_hf(weights, model_cfg, vocab, repeats)))
    weights.clear()
    gc.collect()
    torch.cuda.empty_cache()

    leaks: list = []
    sink = lambda rec: leaks.append(rec) if is_leak(rec) else None  # noqa: E731
    cfg = EngineConfig(
        model=MODEL,
        dtype="bfloat16",
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=8192,
    )
    start = time.perf_counter()
    engine = local_engine(cfg, sinks=[sink])
    worker = engine.executor.worker
    report["engine_start_seconds"] = round(time.perf_counter() - start, 1)
    report["memory_plan"] = attrs.asdict(engine.memory_plan)
    report["peak_after_warmup"] = engine.warmup_figures.measured_peak_bytes
    report["peak_after_capture"] = peak_figures(
        with_peaks(PhaseFigures(), worker.device, worker.memory_plan)
    )

    ceilings = Ceilings(bandwidth, rate, total_bytes, read_bytes, model_cfg.num_params)
    for batch in (1, 256):
        attempt(
            report,
            f"profile_{batch}",
            lambda b=batch: report.update(
                {f"kernels_batch{b}": kernel_profile(worker, b, CONTEXT)}
            ),
        )
    if options.sweep:
        attempt(report, "sweep", lambda: report.update(attention_sweep=attention_sweep(worker)))
    report["decode_step"] = step_table(worker, ceilings, options.max_num_seqs)
    if "kernels_batch256" in report and 256 in report["decode_step"]:
        m = model_cfg  # K and V of every layer, for 256 sequences of context + 1 tokens, bf16
        kv_bytes = 256 * (CONTEXT + 1) * m.num_layers * 2 * m.num_kv_heads * m.head_dim * 2
        kernels, step = report["kernels_batch256"], report["decode_step"][256]
        attempt(
            report,
            "floor",
            lambda: report.update(floor_batch256=step_floor(kernels, step, kv_bytes, bandwidth)),
        )
    # the baseline: after warm-up, capture and every measurement above (none empties the cache)
    after_capture = allocator()
    report["allocator_after_capture"] = after_capture

    save(report, options.out)
    clock = StepClock(engine)
    run_throughput(engine, clock, 8, vocab)  # warm the serving loop
    for batch in (1, 64, 256):
        if batch <= options.max_num_seqs:
            runs = [
                run_throughput(engine, clock, batch, vocab, run) for run in range(options.repeats)
            ]
            result = cold_and_warm([r["tok_per_s"] for r in runs])
            result["last_run"] = runs[-1]
            report[f"memstep_{batch}"] = result
            print(f"memstep {batch} concurrent: {result['runs_tok_per_s']} tok/s", flush=True)
            hf = report.get(f"hf_{batch}")
            if hf:
                report[f"speedup_vs_hf_{batch}"] = {
                    key: round(result[key] / hf[key], 2)
                    for key in ("cold_tok_per_s", "warm_tok_per_s")
                    if result[key] and hf[key]
                }

    save(report, options.out)
    attempt(
        report,
        "memory_run",
        lambda: report.update(
            memory_run=memory_run(engine, options.memory_requests, options.max_num_seqs)
        ),
    )
    final = allocator()
    report["allocator_after_memory_run"] = final
    report["new_segments"] = final["segments"] - after_capture["segments"]
    report["new_reserved_bytes"] = final["reserved_bytes"] - after_capture["reserved_bytes"]
    report["leaks_reported"] = [str(leak) for leak in leaks]
    report["graph_replays"] = worker.graphs.num_replays
    report["decode_steps_replayed_ahead"] = worker.graphs.num_ahead
    report["decode_steps_replayed_ahead_used"] = worker.graphs.num_ahead_used

    save(report, options.out)
    if options.fp8_kv:
        bf16_blocks = engine.memory_plan.num_kv_blocks
        clock.close()
        engine.shutdown()
        del engine, worker, clock
        gc.collect()
        torch.cuda.empty_cache()
        report["allocated_after_shutdown"] = torch.cuda.memory_allocated()
        attempt(
            report,
            "fp8_kv",
            lambda: report.update(fp8_kv=fp8_kv_section(cfg, ceilings, vocab, bf16_blocks)),
        )
        save(report, options.out)
    print_summary(report)


def attempt(report: dict, name: str, fn) -> None:
    """Run one section; a failure is recorded in the report instead of ending the run."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a benchmark keeps going past one broken section
        report.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
        print(f"section {name} failed: {exc!r}", flush=True)


def save(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu.json").write_text(json.dumps(report, indent=1, default=str))


def print_summary(r: dict) -> None:
    print("\n== ceilings ==")
    print(
        f"copy bandwidth {r['copy_bw_tb_s']} TB/s (read + write); bf16 matmul "
        f"{r['matmul_tflops']} TFLOP/s; weights {r['weight_bytes'] / 1e9:.2f} GB, "
        f"read per step {r['weight_bytes_read_per_step'] / 1e9:.2f} GB"
    )
    print("\n== decode step (graph replay + lm_head) ==")
    print(
        f"{'batch':>5} {'graph ms':>9} {'step ms':>8} {'weight roof':>11} {'compute roof':>12}"
        f" {'ratio':>6}"
    )
    for batch, s in r["decode_step"].items():
        print(
            f"{batch:>5} {s['graph_ms']:>9} {s['graph_plus_head_ms']:>8} "
            f"{s['weight_roofline_ms']:>11} {s['compute_roofline_ms']:>12} "
            f"{s['ratio_to_max_roofline']:>6}"
        )
    print("issue's definition (all weight bytes; 2 x all parameters x batch FLOPs):")
    for batch, s in r["decode_step"].items():
        print(
            f"{batch:>5} weight roof {s['issue_weight_roofline_ms']} ms, compute roof "
            f"{s['issue_compute_roofline_ms']} ms, ratio {s['issue_ratio']}"
        )
    floor = r.get("floor_batch256")
    if floor:
        print(
            f"batch 256 floor (attention at the copy bandwidth, other kernels as measured, no "
            f"gaps): {floor['floor_ms']} ms = {floor['issue_ratio_of_floor']}x the issue's roof "
            f"({floor['kernels_but_attention_ms']} ms of other kernels, attention "
            f"{floor['attention_ms']} -> {floor['attention_at_copy_bandwidth_ms']} ms, head "
            f"{floor['head_ms']} ms)"
        )
    for row in r.get("attention_sweep", []):
        print("attention", row)
    print("\n== throughput, 128 prompt + 128 output tokens ==")
    print("(cold: the first run at a size; warm: the median of the runs after it)")
    for batch in (1, 64, 256):
        m = r.get(f"memstep_{batch}")
        if m:
            hf = r.get(f"hf_{batch}", {})
            print(
                f"{batch:>4} concurrent: memstep cold {m['cold_tok_per_s']} warm "
                f"{m['warm_tok_per_s']} tok/s; HF cold {hf.get('cold_tok_per_s')} warm "
                f"{hf.get('warm_tok_per_s')} tok/s; speedup {r.get(f'speedup_vs_hf_{batch}')}"
            )
            last = m["last_run"]
            print(f"      last run: {last['steps']} steps, decode step {last['decode_steps']}")
    if "hf_step_ms_batch1" in r:
        print(f"HF decode step at batch 1: {r['hf_step_ms_batch1']} ms")
    print("\n== memory ==")
    plan = r["memory_plan"]
    print(
        f"predicted peak {plan['predicted_peak_bytes'] / 1e9:.2f} GB, measured after warm-up "
        f"{(r['peak_after_warmup'] or 0) / 1e9:.2f} GB, after capture "
        f"{r['peak_after_capture']['measured_peak_bytes'] / 1e9:.2f} GB "
        f"(error {r['peak_after_capture']['peak_error']}); KV pages {plan['num_kv_blocks']}"
    )
    print(
        f"memory run {r['memory_run']}: new segments {r['new_segments']}, new reserved bytes "
        f"{r['new_reserved_bytes']}, leaks reported {len(r['leaks_reported'])}, "
        f"graph replays {r['graph_replays']}"
    )
    fp8 = r.get("fp8_kv")
    if fp8:
        print("\n== fp8 KV cache (kv_cache_dtype='fp8': another configuration) ==")
        left = r["allocated_after_shutdown"]
        print(f"(the bf16 engine shut down first: {left} bytes still allocated)")
        print(
            f"KV pages {fp8['num_kv_blocks']} ({fp8['blocks_vs_bf16']}x the bf16 cache's); "
            f"peak error {fp8['peak_after_capture']['peak_error']}"
        )
        for batch, s in fp8["decode_step"].items():
            print(f"{batch:>5} step {s['graph_plus_head_ms']} ms, issue's ratio {s['issue_ratio']}")
        for batch in (64, 256):
            print(f"{batch:>4} concurrent: {fp8.get(f'memstep_{batch}_tok_per_s')} tok/s (one run)")


if __name__ == "__main__":
    main()
