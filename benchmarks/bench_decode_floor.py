"""The floor under issue 15's Must show 3, second half: the most of bench_mixed's ideal engine
that any engine built from this device's kernels can reach, at 64 and 256 concurrent requests.

Every decode step must read the weights through the layers' matmuls, run the head, and read
its sequences' K and V. The floor times only those, each at its best on this device, in this
run, on random:llama-3.1-8b's own bf16 weights:

- the 32 layers' four matmuls (qkv, wo, gate_up, down) in one CUDA graph: cuBLAS, as the
  engine calls it; and at 64 rows a Triton skinny GEMM tuned over tile shapes, with and
  without programmatic dependent launch (PDL). The fastest counts;
- the head, [rows, hidden] -> float32 logits (cuBLAS, as `LlamaModel.logits`);
- K and V at the device's pure read rate (a sum over 4 GiB in a CUDA graph): no attention
  kernel reads them faster;

plus the prompts' FLOPs at the matmul rate (the ideal's own prefill). Nothing else costs
anything in the floor: no norms, rotary, silu, attention arithmetic, sampling or host work.
So an engine reaches at most `floor_of_ideal` of the ideal.

At 256 rows it also measures overlap as NanoFlow does it: the step as two micro-batches of
128 on two streams, each layer's four matmuls with its half's KV read between qkv and wo,
against the whole batch on one stream. The ideal counts a step at the larger of its weights +
KV read and its FLOPs; an engine can only get there by running attention beside the matmuls.

    python benchmarks/bench_decode_floor.py [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from common import (
    CONTEXT,
    MODEL,
    OUTPUT_LEN,
    PROMPT_LEN,
    copy_bandwidth,
    decode_feeds,
    ideal_run,
    kernel_times,
    matmul_rate,
    median_ms,
    model_step_ms,
)

MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")
ATTENTION_KERNELS = ("_decode_kernel", "_merge_partitions_kernel")
MATMUL_KERNELS = ("gemm", "nvjet", "xmma", "cutlass", "cublas")  # cuBLAS's names, lower case


def engine_step(worker, batch: int) -> dict:
    """The engine's decode step at `batch` (its graph, + the head) and the graph's kernels as
    the profiler sees them in a replay, summed by kind: cuBLAS matmuls, decode attention, and
    the rest (memstep's norms, rotary + KV write and silu * up; the embedding gather, copies)."""
    step = model_step_ms(worker, batch, CONTEXT)
    runner = worker.graphs
    runner.drop_ahead()
    size = runner.padded_size(batch)
    with torch.inference_mode():
        runner.inputs.fill(decode_feeds(batch, CONTEXT, worker.cfg.block_size), size)
        kernels = kernel_times(runner.graphs[size].replay, 5)
    kinds = {"matmuls": 0.0, "attention": 0.0, "other": 0.0}
    for row in kernels:
        name = row["kernel"]
        if name in ATTENTION_KERNELS:
            kinds["attention"] += row["ms_per_run"]
        elif any(part in name.lower() for part in MATMUL_KERNELS):
            kinds["matmuls"] += row["ms_per_run"]
        else:
            kinds["other"] += row["ms_per_run"]
    return step | {f"graph_{k}_ms": round(v, 3) for k, v in kinds.items()}


def floor_run(
    batch: int, model_cfg, weight_bytes: int, step_s: float, read_rate: float, rate: float
) -> dict:
    """The floor engine's time for `batch` requests of PROMPT_LEN + OUTPUT_LEN tokens: the
    prompts' FLOPs at the matmul rate, then OUTPUT_LEN - 1 decode steps, each `step_s` (the
    weights' matmuls and the head) plus its K and V read at `read_rate`."""
    m = model_cfg
    prefill = batch * PROMPT_LEN * weight_bytes / rate  # bf16: as many FLOPs a token as bytes
    kv_per_token = m.num_layers * 2 * m.num_kv_heads * m.head_dim * 2
    decode = sum(
        step_s + batch * (PROMPT_LEN + step) * kv_per_token / read_rate
        for step in range(1, OUTPUT_LEN)
    )
    seconds = prefill + decode
    return {
        "prefill_s": round(prefill, 4),
        "decode_s": round(decode, 4),
        "tok_per_s": round(batch * OUTPUT_LEN / seconds, 1),
    }


def graph_ms(fn: Callable[[], object], iters: int = 30) -> float:
    """Median milliseconds of one replay of `fn` captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, tune and allocate outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, iters, warmup=3)


def read_rate() -> float:
    """Bytes a second a sum over 4 GiB of bf16 reads (in a CUDA graph)."""
    data = torch.empty(2 * 2**30, device="cuda", dtype=torch.bfloat16).normal_()
    out = torch.empty((), device="cuda", dtype=torch.float32)
    ms = graph_ms(lambda: torch.sum(data, dim=0, dtype=torch.float32, out=out))
    return data.numel() * 2 / (ms / 1e3)


def skinny_kernel():
    """A Triton GEMM for at most 64 rows: a program per BLOCK_N columns streams its weight rows
    once, all rows of x against them; with PDL it launches while the previous kernel drains."""
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def skinny(
        x_ptr,
        w_ptr,
        o_ptr,
        M,
        N,
        K,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        rm = tl.arange(0, 64)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        acc = tl.zeros((64, BLOCK_N), tl.float32)
        xp = x_ptr + rm[:, None] * K + rk[None, :]
        wp = w_ptr + rn[:, None] * K + rk[None, :]
        for _ in range(0, K, BLOCK_K):
            x = tl.load(xp, mask=rm[:, None] < M, other=0.0)
            acc += tl.dot(x, tl.trans(tl.load(wp)))
            xp += BLOCK_K
            wp += BLOCK_K
        out = o_ptr + rm[:, None] * N + rn[None, :]
        tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=rm[:, None] < M)

    def matmul(x, w, out, config, pdl: bool) -> None:
        block_n, block_k, warps, stages = config
        m, k = x.shape
        n = w.shape[0]
        skinny[(n // block_n,)](
            x,
            w,
            out,
            m,
            n,
            k,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            PDL=pdl,
            num_warps=warps,
            num_stages=stages,
            launch_pdl=pdl,
        )

    return matmul


def layer_gemms(weights, rows: int):
    """The layers' four matmuls on `rows` rows of inputs, as a function for a graph, and its
    buffers: (inputs by matrix, outputs by matrix)."""
    xs, outs = {}, {}
    for name in MATRICES:
        n, k = weights[f"layers.0.{name}"].shape
        xs[name] = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        outs[name] = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    return xs, outs


def cublas_layers(weights, num_layers: int, rows: int) -> Callable[[], None]:
    xs, outs = layer_gemms(weights, rows)

    def run() -> None:
        for i in range(num_layers):
            for name in MATRICES:
                F.linear(xs[name], weights[f"layers.{i}.{name}"])

    return run


def tuned_skinny(weights, num_layers: int, matmul) -> tuple[dict, dict]:
    """The fastest tile shape per matrix for 64 rows, over every layer's copy (L2-cold), and
    each matrix's time a layer: ({name: config}, {name: (skinny us, cuBLAS us)})."""
    xs, outs = layer_gemms(weights, 64)
    configs = [
        (n, k, w, s)
        for n in (32, 64, 128)
        for k in (128, 256)
        for w in (4, 8)
        for s in (4, 6)
        if (n + 64) * k * 2 * s <= 200_000  # shared memory of the pipeline's stages
    ]
    best, times = {}, {}
    for name in MATRICES:
        mats = [weights[f"layers.{i}.{name}"] for i in range(num_layers)]
        ms, best[name] = tune(mats, xs[name], outs[name], matmul, configs)
        cublas = graph_ms(functools.partial(each_layer, F.linear, xs[name], mats))
        times[name] = (round(ms / num_layers * 1e3, 2), round(cublas / num_layers * 1e3, 2))
    return best, times


def each_layer(matmul: Callable, x: torch.Tensor, mats: list[torch.Tensor]) -> None:
    for w in mats:
        matmul(x, w)


def tune(mats, x, out, matmul, configs) -> tuple[float, tuple]:
    """(milliseconds over every layer's copy, config) of the fastest config that computes
    the product."""
    ref = F.linear(x, mats[0]).float()
    results = []
    for config in configs:
        if mats[0].shape[0] % config[0] or mats[0].shape[1] % config[1]:
            continue
        matmul(x, mats[0], out, config, False)
        error = (out.float() - ref).abs().max().item()
        assert error <= 0.02 * ref.abs().max().item(), (config, error)
        one = functools.partial(matmul, out=out, config=config, pdl=False)
        results.append((graph_ms(functools.partial(each_layer, one, x, mats), 10), config))
    return min(results)


def skinny_layers(weights, num_layers: int, matmul, best: dict, pdl: bool):
    xs, outs = layer_gemms(weights, 64)

    def run() -> None:
        for i in range(num_layers):
            for name in MATRICES:
                matmul(xs[name], weights[f"layers.{i}.{name}"], outs[name], best[name], pdl)

    return run


def overlap(weights, num_layers: int, kv_per_token_layer: int, context: int) -> dict:
    """A 256-row step's matmuls and KV reads (sums at the read rate, each half's between its qkv
    and wo): the whole batch on one stream; two halves of 128 on one stream; the halves on two
    streams at once. Milliseconds, with and without the KV reads."""
    elements = 128 * context * kv_per_token_layer  # a half's K and V a layer, bf16
    kv = torch.empty(num_layers, 2, elements, device="cuda", dtype=torch.bfloat16).normal_()
    total = torch.empty((), device="cuda", dtype=torch.float32)
    whole, halves = (
        layer_gemms(weights, 256),
        [layer_gemms(weights, 128) for _ in range(2)],
    )
    side = torch.cuda.Stream()

    def layer(i: int, bufs, parts, reads: bool) -> None:
        xs, outs = bufs
        for name in MATRICES:
            F.linear(xs[name], weights[f"layers.{i}.{name}"])
            if name == "wqkv" and reads:
                for part in parts:
                    torch.sum(kv[i, part], dim=0, dtype=torch.float32, out=total)

    def one(reads: bool) -> Callable[[], None]:
        def run() -> None:
            for i in range(num_layers):
                layer(i, whole, (0, 1), reads)

        return run

    def split(reads: bool) -> Callable[[], None]:
        def run() -> None:
            for i in range(num_layers):
                for h in (0, 1):
                    layer(i, halves[h], (h,), reads)

        return run

    def streams(reads: bool) -> Callable[[], None]:
        def run() -> None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            for i in range(num_layers):
                layer(i, halves[0], (0,), reads)
            with torch.cuda.stream(side):
                for i in range(num_layers):
                    layer(i, halves[1], (1,), reads)
            main.wait_stream(side)

        return run

    report = {}
    for name, make in (
        ("whole", one),
        ("halves_one_stream", split),
        ("halves_two_streams", streams),
    ):
        for reads in (False, True):
            report[f"{name}{'_with_kv' if reads else ''}_ms"] = round(graph_ms(make(reads)), 3)
    return report


def logits_of(hidden: torch.Tensor, lm_head: torch.Tensor, out: torch.Tensor) -> None:
    torch.mm(hidden, lm_head.t(), out_dtype=out.dtype, out=out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_floor needs a CUDA device")
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from memstep.core.config import EngineConfig
    from memstep.executors.process.inprocess import local_engine

    # bench_mixed's engine, with room beside it for this benchmark's own buffers (~12 GB)
    cfg = EngineConfig(
        model=MODEL,
        dtype="bfloat16",
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.6,
    )
    engine = local_engine(cfg)
    worker = engine.executor.worker
    model_cfg, weights = worker.model_cfg, worker.weights
    weight_bytes = sum(t.numel() * t.element_size() for n, t in weights.items() if n != "embed")
    layers = model_cfg.num_layers
    bandwidth, rate, reads = copy_bandwidth(), matmul_rate(), read_rate()
    report: dict = {
        "device": torch.cuda.get_device_name(),
        "model": f"{MODEL} bf16",
        "copy_bw_tb_s": round(bandwidth / 1e12, 3),
        "read_tb_s": round(reads / 1e12, 3),
        "matmul_tflops": round(rate / 1e12, 1),
    }
    print(
        f"copy {bandwidth / 1e12:.2f} TB/s, read {reads / 1e12:.2f} TB/s,"
        f" bf16 matmul {rate / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    matmul = skinny_kernel()
    best, per_matrix = tuned_skinny(weights, layers, matmul)
    report["skinny_64"] = {"configs": best, "us_a_layer_skinny_vs_cublas": per_matrix}
    print(f"64 rows, us a layer (skinny, cuBLAS): {per_matrix}", flush=True)
    lm_head = weights.get("lm_head", weights["embed"])
    for batch in (64, 256):
        engine_ms = engine_step(worker, batch)
        gemms = {"cublas": graph_ms(cublas_layers(weights, layers, batch))}
        if engine_ms["graph_matmuls_ms"] > 0:  # the profiler saw the graph's kernels
            gemms["engine"] = engine_ms["graph_matmuls_ms"]
        if batch == 64:
            for pdl in (False, True):
                run = skinny_layers(weights, layers, matmul, best, pdl)
                gemms["skinny_pdl" if pdl else "skinny"] = graph_ms(run)
        hidden = torch.randn(batch, model_cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        logits = torch.empty(batch, lm_head.shape[0], device="cuda", dtype=torch.float32)
        head = graph_ms(functools.partial(logits_of, hidden, lm_head, logits))
        step_ms = min(gemms.values()) + head
        ideal = ideal_run(batch, model_cfg, weight_bytes, bandwidth, rate)
        floor = floor_run(batch, model_cfg, weight_bytes, step_ms / 1e3, reads, rate)
        share = floor["tok_per_s"] / ideal["tok_per_s"]
        report[f"concurrent_{batch}"] = {
            "engine_step": engine_ms,
            "layer_gemms_ms": {k: round(v, 3) for k, v in gemms.items()},
            "head_ms": round(head, 3),
            "ideal": ideal,
            "floor": floor,
            "floor_of_ideal": round(share, 3),
        }
        print(f"engine's decode step at {batch}: {engine_ms}", flush=True)
        print(
            f"{batch} concurrent: layers' matmuls {report[f'concurrent_{batch}']['layer_gemms_ms']}"
            f" ms, head {head:.3f} ms; ideal {ideal['tok_per_s']} tok/s, floor"
            f" {floor['tok_per_s']} tok/s -> at most {share:.1%} of the ideal (goal >= 85%)",
            flush=True,
        )
    kv_per_token_layer = 2 * model_cfg.num_kv_heads * model_cfg.head_dim
    context = PROMPT_LEN + OUTPUT_LEN // 2
    report["overlap_256"] = overlap(weights, layers, kv_per_token_layer, context)
    print(f"256 rows as one batch / two micro-batches: {report['overlap_256']}", flush=True)
    options.out.mkdir(parents=True, exist_ok=True)
    engine.shutdown()
    (options.out / "bench_decode_floor.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
