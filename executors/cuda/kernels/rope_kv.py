"""Rotary embedding of q and k fused with the write of k and v into the paged KV cache.

One launch per layer replaces the dozen small torch kernels of `apply_rope` + `write_kv`. The
rotary convention is Hugging Face's (rotate halves); tables are the model's fp32 cos/sin rows.
A token whose slot is negative (a padding row of a captured batch) writes nothing to the cache.
An fp8 cache gets values clamped to its finite range, as `kv_cache.to_cache` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memstep.executors.model.kv_cache import KV_FP8, KV_FP8_MAX, write_kv


@triton.jit
def _as_cached(x, cache_ptr, LIMIT: tl.constexpr):
    """x in the cache's element type; clamped to +-LIMIT first when LIMIT > 0 (fp8)."""
    if LIMIT > 0:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -LIMIT), LIMIT)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _head_norm(x1, x2, is_q, is_k, q_norm_ptr, k_norm_ptr, offs, mask_d, half, eps):
    """q and k heads' RMSNorm over both halves ([HEADS, HALF_PAD] each); v heads unchanged."""
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    rstd = tl.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * half) + eps)[:, None]
    wq1 = tl.load(q_norm_ptr + offs, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    wq2 = tl.load(q_norm_ptr + half + offs, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    wk1 = tl.load(k_norm_ptr + offs, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    wk2 = tl.load(k_norm_ptr + half + offs, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    w1 = tl.where(is_q[:, None], wq1, wk1)
    w2 = tl.where(is_q[:, None], wq2, wk2)
    n1 = ((f1 * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype)
    n2 = ((f2 * rstd).to(x2.dtype).to(tl.float32) * w2).to(x2.dtype)
    is_qk = (is_q | is_k)[:, None]
    return tl.where(is_qk, n1, x1), tl.where(is_qk, n2, x2)


@triton.jit
def _rope_kv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    slots_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    stride_qkv,
    stride_cos,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS: tl.constexpr,
    KV_LIMIT: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    """Grid (num_tokens, cdiv(num_heads + 2 * num_kv_heads, HEADS)): HEADS consecutive heads of
    the q, k, v rows of one token per program. q heads are rotated in place in qkv; k heads are
    rotated into the cache; v heads are copied there. With QK_NORM each q and k head is first
    RMS-normed with its weight (q_norm, k_norm: [HEAD_DIM]), rounded as the RMSNorm kernel
    rounds."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # [HEADS]
    half = HEAD_DIM // 2
    offs = tl.arange(0, HALF_PAD)
    mask_d = offs < half
    is_q = heads < NUM_HEADS
    is_k = (heads >= NUM_HEADS) & (heads < NUM_HEADS + NUM_KV_HEADS)
    is_v = (heads >= NUM_HEADS + NUM_KV_HEADS) & (heads < NUM_HEADS + 2 * NUM_KV_HEADS)
    rows = qkv_ptr + token * stride_qkv + heads[:, None] * HEAD_DIM + offs[None, :]
    live = (is_q | is_k | is_v)[:, None] & mask_d[None, :]
    x1 = tl.load(rows, mask=live, other=0.0)
    x2 = tl.load(rows + half, mask=live, other=0.0)
    if QK_NORM:
        x1, x2 = _head_norm(x1, x2, is_q, is_k, q_norm_ptr, k_norm_ptr, offs, mask_d, half, eps)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=mask_d, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + offs, mask=mask_d, other=0.0)[None, :]
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = (x1f * cos - x2f * sin).to(x1.dtype)
    o2 = (x2f * cos + x1f * sin).to(x1.dtype)
    q_mask = is_q[:, None] & mask_d[None, :]
    tl.store(rows, o1, mask=q_mask)
    tl.store(rows + half, o2, mask=q_mask)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    # a vector mask: the interpreter rejects a scalar bool broadcast into a mask
    has_slot = tl.full([HEADS], slot, tl.int64) >= 0
    page = slot // BLOCK_SIZE
    in_page = slot % BLOCK_SIZE
    k_heads = tl.where(is_k, heads - NUM_HEADS, 0)
    k_dst = k_cache_ptr + page * stride_k_block + in_page * stride_k_slot
    k_dst = k_dst + k_heads[:, None] * stride_k_head + offs[None, :]
    k_mask = (is_k & has_slot)[:, None] & mask_d[None, :]
    tl.store(k_dst, _as_cached(o1, k_cache_ptr, KV_LIMIT), mask=k_mask)
    tl.store(k_dst + half, _as_cached(o2, k_cache_ptr, KV_LIMIT), mask=k_mask)
    v_heads = tl.where(is_v, heads - NUM_HEADS - NUM_KV_HEADS, 0)
    v_dst = v_cache_ptr + page * stride_v_block + in_page * stride_v_slot
    v_dst = v_dst + v_heads[:, None] * stride_v_head + offs[None, :]
    v_mask = (is_v & has_slot)[:, None] & mask_d[None, :]
    tl.store(v_dst, _as_cached(x1, v_cache_ptr, KV_LIMIT), mask=v_mask)
    tl.store(v_dst + half, _as_cached(x2, v_cache_ptr, KV_LIMIT), mask=v_mask)


_HEADS_PER_PROGRAM = 8


def rope_and_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """qkv: [T, (H + 2 * KVH) * D] rows of q, k, v heads; cos, sin: [P, D/2] fp32 tables;
    positions, slots: [T] integer; k_cache, v_cache: [num_blocks, block_size, KVH, D];
    `qk_norm`: (q_norm, k_norm, eps), each q and k head RMS-normed first ([D] weights: Qwen3's,
    Gemma 3's).

    Rotates q in place (returned as a [T, H, D] view of qkv) and writes rotated k and plain v
    to flat slot `slots[t]` of the caches (nothing where the slot is negative). Allocates
    nothing and never syncs, so it can be captured in a CUDA graph."""
    num_tokens = qkv.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [T, (H + 2 KVH) * D] with unit stride")
    if cos.shape[-1] * 2 != head_dim or cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError("cos and sin must be [P, head_dim / 2] tables with the same layout")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or head_dim % 2:
        raise ValueError("caches need a contiguous, even head_dim")
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    if num_tokens == 0:
        return q
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    if qk_norm is not None and (q_norm.shape != (head_dim,) or k_norm.shape != (head_dim,)):
        raise ValueError(f"q/k norm weights must be [{head_dim}]")
    grid = (num_tokens, triton.cdiv(num_heads + 2 * num_kv_heads, _HEADS_PER_PROGRAM))
    _rope_kv_kernel[grid](
        qkv,
        cos,
        sin,
        positions,
        slots,
        k_cache,
        v_cache,
        q_norm,
        k_norm,
        eps,
        qkv.stride(0),
        cos.stride(0),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        BLOCK_SIZE=block_size,
        HEADS=_HEADS_PER_PROGRAM,
        KV_LIMIT=KV_FP8_MAX if k_cache.dtype == KV_FP8 else 0.0,
        QK_NORM=qk_norm is not None,
        num_warps=4,
    )
    return q


def rope_and_write_kv_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """Plain-torch `rope_and_write_kv`."""
    t = qkv.shape[0]
    _, _, kvh, d = k_cache.shape
    q, k, v = qkv.split([num_heads * d, kvh * d, kvh * d], dim=-1)
    c = cos[positions.long()].unsqueeze(1)
    s = sin[positions.long()].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    q_rot = rotate(q.reshape(t, num_heads, d))
    k_rot = rotate(k.reshape(t, kvh, d))
    keep = slots >= 0
    rows = slots[keep].long()
    write_kv(k_cache, v_cache, k_rot[keep], v.reshape(t, kvh, d)[keep], rows)
    qv = qkv[:, : num_heads * d].view(t, num_heads, d)
    qv.copy_(q_rot)
    return qv
