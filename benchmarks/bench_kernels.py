"""Decode attention on Llama-3.1-8B shapes: the Triton paged kernel against plain torch.

Times, per batch size, `paged_decode_attention`, its torch reference, and
`scaled_dot_product_attention` on K/V already gathered into contiguous tensors (and with the
gather included). Prints median times from CUDA events, with the L2 flushed before each run,
and the bandwidth achieved on the KV bytes one layer must read.

    python benchmarks/bench_kernels.py [--batches 1 64 256] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import median_ms

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3.1-8B, one layer
DTYPE = torch.bfloat16


def bench_batch(batch: int, seq_len: int, iters: int, l2_flush: torch.Tensor) -> list[tuple]:
    from memstep.core.shapes import cdiv
    from memstep.executors.cuda.kernels import (
        DecodeWorkspace,
        paged_attention_reference,
        paged_decode_attention,
    )

    blocks_per_seq = cdiv(seq_len, BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(cache_shape, device="cuda", dtype=DTYPE)
    # shuffled pages, as after the block manager has recycled them for a while
    pages = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    block_tables = pages.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    workspace = DecodeWorkspace.allocate(batch, NUM_HEADS, HEAD_DIM, seq_len, "cuda")
    args = (q, k_cache, v_cache, block_tables, seq_lens, scale)

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # [batch, seq, kv_heads, dim] -> [batch, kv_heads, seq, dim]
        flat = cache[block_tables.long()].flatten(1, 2)[:, :seq_len]
        return flat.transpose(1, 2).contiguous()

    k_dense, v_dense = gather(k_cache), gather(v_cache)
    q_sdpa = q.unsqueeze(2)  # [batch, heads, 1, dim]

    def sdpa(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q_sdpa, k, v, scale=scale, enable_gqa=True)

    variants: dict[str, Callable[[], object]] = {
        "triton (heuristic)": lambda: paged_decode_attention(*args, out, workspace),
        "triton unsplit": lambda: paged_decode_attention(*args, out, workspace, split=False),
        "triton split-K": lambda: paged_decode_attention(*args, out, workspace, split=True),
        "torch reference": lambda: paged_attention_reference(*args),
        "sdpa, pre-gathered": lambda: sdpa(k_dense, v_dense),
        "gather + sdpa": lambda: sdpa(gather(k_cache), gather(v_cache)),
    }
    expected = sdpa(k_dense, v_dense).squeeze(2).float()
    paged_decode_attention(*args, out, workspace)
    max_error = (out.float() - expected).abs().max().item()

    kv_bytes = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    rows = []
    for name, fn in variants.items():
        ms = median_ms(fn, iters, l2_flush)
        rows.append((batch, seq_len, name, ms, kv_bytes / ms / 1e6))
    print(f"batch {batch}: triton vs sdpa max abs diff {max_error:.2e}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--iters", type=int, default=50)
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA device")
    torch.manual_seed(0)
    l2_flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")  # several x L2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Llama-3.1-8B layer, bf16")
    rows = [
        row
        for batch in options.batches
        for row in bench_batch(batch, options.seq_len, options.iters, l2_flush)
    ]
    print(f"{'batch':>5} {'seq':>5}  {'variant':<20} {'median ms':>10} {'KV GB/s':>9}")
    for batch, seq_len, name, ms, gbps in rows:
        print(f"{batch:>5} {seq_len:>5}  {name:<20} {ms:>10.4f} {gbps:>9.1f}")


if __name__ == "__main__":
    main()
