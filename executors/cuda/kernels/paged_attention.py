"""Decode attention over a paged KV cache: one query token per sequence, GQA heads.

`paged_decode_attention` is the entry point; `paged_attention_reference` is the plain-torch
definition it is tested against. The cache layout is the engine's: per layer, `k_cache` and
`v_cache` are `[num_blocks, block_size, num_kv_heads, head_dim]`, and token position `p` of a
sequence lives at `cache[block_table[p // block_size], p % block_size]`. The cache may hold
fp8 (`kv_cache`): tiles are converted to q's dtype as they are loaded.

One program handles every query head of one KV head group, so each KV page is read once per
group. When the batch is too small to fill the GPU, the sequence is split into partitions
(split-K, flash-decoding style) whose partial results a second kernel merges.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from memstep.executors.model.kv_cache import KV_FP8

DEFAULT_PARTITION_SIZE = 256
_LOG2E = 1.4426950408889634
_BLOCK_N = 64  # tokens per tile; several pages when block_size is small
# An fp8 cache's tiles are converted in registers, and fp16 dots on 128-token tiles beat bf16
# dots on 64-token ones at long contexts (docs/benchmarks.md, "Figures behind the code's
# constants").
_FP8_BLOCK_N = 128
_FP16_MAX = tl.constexpr(65504.0)
_MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows on the GPU
_NUM_WARPS = 4  # tile shape and pipelining: best overall in a sweep (docs/benchmarks.md)
_NUM_STAGES = 2


# the block-table width changes from step to step on the eager path: specializing on it
# (divisible by 16, equal to 1) would compile a new variant in the middle of serving
@triton.jit(do_not_specialize=["stride_bt_seq"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    bases_ptr,
    remap_ptr,
    qk_scale,
    window,
    stride_q_seq,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    stride_remap_seq,
    stride_o_seq,
    stride_o_head,
    stride_o_part,
    stride_lse_seq,
    stride_lse_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOT: tl.constexpr,
    HAS_TREE: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    """Grid (num_seqs, num_kv_heads, num_partitions). Unsplit: writes out. Split: writes the
    partition's normalised output and its log2-sum-exp, for `_merge_partitions_kernel`. With
    HAS_TREE a row's positions from bases[seq] on are read at remap[seq, p - base] (a draft
    tree node's ancestors, then itself). WINDOWED: only the last `window` positions are read (a
    sliding-window layer); a partition wholly before them is live but empty. Without it the
    tiles start at the partition's start, a multiple of BLOCK_N the compiler can see (a start
    chosen at run time would hide it from the loads' vectorization)."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if IS_SPLIT:
        start = part * PARTITION_SIZE
        end = tl.minimum(start + PARTITION_SIZE, seq_len)
    else:
        start = 0
        end = seq_len
    if WINDOWED:  # noqa: SIM108 (a statement Triton compiles as the IS_SPLIT branch above)
        first = tl.maximum(start, seq_len - window)
    else:
        first = start

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_g = offs_g < GROUP_SIZE
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP_SIZE + offs_g
    # q: [GROUP_PAD, HEAD_DIM_PAD], padding rows are zero and dropped at the store
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )

    if FP16_DOT:  # fp8 K/V convert to fp16 exactly; q is clamped into fp16's range
        q = tl.minimum(tl.maximum(q.to(tl.float32), -_FP16_MAX), _FP16_MAX).to(tl.float16)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    block_table = block_tables_ptr + seq * stride_bt_seq
    k_head = k_cache_ptr + kv_head * stride_k_head
    v_head = v_cache_ptr + kv_head * stride_v_head
    for tile_start in range(first, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        pos = offs_n
        if HAS_TREE:
            base = tl.load(bases_ptr + seq)
            in_tree = mask_n & (offs_n >= base)
            mapped = tl.load(remap_ptr + seq * stride_remap_seq + offs_n - base, in_tree, other=0)
            pos = tl.where(in_tree, mapped, offs_n)
        # int64: page * stride_block overflows int32 on large caches
        page = tl.load(block_table + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        # k, v: [BLOCK_N, HEAD_DIM_PAD]
        k_rows = page * stride_k_block + slot * stride_k_slot
        k = tl.load(k_head + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        k = k.to(q.dtype)  # an fp8 cache is read in q's dtype (fp16 with FP16_DOT)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        # every tile holds at least one valid token, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = page * stride_v_block + slot * stride_v_slot
        v = tl.load(v_head + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # an empty range (seq_len 0, or a partition past the end) gives l_i == 0: write zeros
    has_tokens = l_i > 0
    acc = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    store_mask = mask_g[:, None] & mask_d[None, :]
    o_ptrs = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :]
    if IS_SPLIT:
        # partitions past the end are never merged: skip their stores. A vector mask, as the
        # interpreter rejects a scalar bool broadcast into a mask.
        is_live = tl.full([GROUP_PAD], start, tl.int32) < end
        o_ptrs += part * stride_o_part
        store_mask &= is_live[:, None]
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        lse_ptrs = lse_ptr + seq * stride_lse_seq + heads * stride_lse_head + part
        tl.store(lse_ptrs, lse, mask=mask_g & is_live)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _merge_partitions_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_po_seq,
    stride_po_head,
    stride_po_part,
    stride_lse_seq,
    stride_lse_head,
    stride_o_seq,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    NUM_PARTS_PAD: tl.constexpr,
):
    """Grid (num_seqs, num_heads). Merges the partitions a sequence actually covers."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, PARTITION_SIZE)

    lse_row = partial_lse_ptr + seq * stride_lse_seq + head * stride_lse_head
    offs_p = tl.arange(0, NUM_PARTS_PAD)
    lse = tl.load(lse_row + offs_p, mask=offs_p < num_parts, other=float("-inf"))
    lse_max = tl.where(num_parts > 0, tl.max(lse, 0), 0.0)  # seq_len 0: no partitions
    weights = tl.where(offs_p < num_parts, tl.exp2(lse - lse_max), 0.0)
    weight_sum = tl.sum(weights, 0)

    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    po_row = partial_out_ptr + seq * stride_po_seq + head * stride_po_head
    for part in range(0, num_parts):
        weight = tl.exp2(tl.load(lse_row + part) - lse_max)
        acc += weight * tl.load(po_row + part * stride_po_part + offs_d, mask=mask_d, other=0.0)
    acc = acc / tl.where(weight_sum > 0, weight_sum, 1.0)
    o_ptrs = out_ptr + seq * stride_o_seq + head * stride_o_head + offs_d
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_d)


def num_partitions(max_context_len: int, partition_size: int) -> int:
    return triton.cdiv(max_context_len, partition_size)


@dataclass(frozen=True)
class DecodeWorkspace:
    """fp32 scratch for the split-K path, allocated once so a captured call allocates nothing.

    Owned by the caller and overwritten by every split call; sized for up to `max_num_seqs`
    sequences whose block tables span up to `max_context_len` tokens.
    """

    partial_out: torch.Tensor  # [max_num_seqs, num_heads, max_partitions, head_dim]
    partial_lse: torch.Tensor  # [max_num_seqs, num_heads, max_partitions]
    partition_size: int = DEFAULT_PARTITION_SIZE

    @classmethod
    def allocate(
        cls,
        max_num_seqs: int,
        num_heads: int,
        head_dim: int,
        max_context_len: int,
        device: torch.device | str,
        partition_size: int = DEFAULT_PARTITION_SIZE,
    ) -> DecodeWorkspace:
        max_parts = num_partitions(max_context_len, partition_size)
        partial_out = torch.empty(
            max_num_seqs, num_heads, max_parts, head_dim, dtype=torch.float32, device=device
        )
        partial_lse = torch.empty(
            max_num_seqs, num_heads, max_parts, dtype=torch.float32, device=device
        )
        return cls(partial_out, partial_lse, partition_size)

    def check_fits(self, num_seqs: int, num_heads: int, head_dim: int, num_parts: int) -> None:
        max_seqs, ws_heads, max_parts, ws_head_dim = self.partial_out.shape
        if num_seqs > max_seqs or num_heads != ws_heads or head_dim != ws_head_dim:
            raise ValueError(
                f"workspace is for {max_seqs} seqs x {ws_heads} heads x {ws_head_dim} dims, "
                f"call needs {num_seqs} x {num_heads} x {head_dim}"
            )
        if num_parts > max_parts:
            raise ValueError(f"workspace holds {max_parts} partitions, call needs {num_parts}")


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # interpreter: splitting buys nothing
    return torch.cuda.get_device_properties(device).multi_processor_count


def use_split_k(
    num_seqs: int,
    num_kv_heads: int,
    max_context_len: int,
    num_sms: int,
    partition_size: int = DEFAULT_PARTITION_SIZE,
) -> bool:
    """Split when one program per (sequence, KV head) gives under two waves of programs and a
    sequence can span more than one partition. Decided from shapes only, so a captured graph
    replays one path (measured: docs/benchmarks.md, "Figures behind the code's constants")."""
    return num_seqs * num_kv_heads < 2 * num_sms and max_context_len > partition_size


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
            f"[num_blocks, block_size, num_kv_heads, {head_dim}]"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} "
            f"do not match {num_seqs} sequences"
        )
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous head_dim")
    if block_tables.stride(1) != 1 or not seq_lens.is_contiguous():
        raise ValueError("block_tables rows and seq_lens must be contiguous")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    split: bool | None = None,
    bases: torch.Tensor | None = None,
    remap: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Attention of one query token per sequence over its cached positions 0..seq_len-1
    (with `window` > 0 over the last `window` of them only: a sliding-window layer's).

    q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs]
    int32. Query head h reads KV head h // (num_heads // num_kv_heads). A sequence with
    seq_len 0 (a padding slot) gets zeros. Writes and returns `out` ([num_seqs, num_heads,
    head_dim], allocated like q when None). `split` forces or forbids split-K; None lets
    `use_split_k` decide. With `out` and `workspace` given, nothing is allocated and nothing
    syncs with the host, so the call can be captured in a CUDA graph. Draft tree rows:
    `bases` [num_seqs] int32 and `remap` [num_seqs, R] int32, a row's positions from its base
    on read at remap[row, p - base] (`AttnGroup.query_remap`).
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    max_context_len = block_tables.shape[1] * block_size
    partition_size = workspace.partition_size if workspace is not None else DEFAULT_PARTITION_SIZE
    if split is None:
        num_sms = _num_sms(q.device)
        split = use_split_k(num_seqs, num_kv_heads, max_context_len, num_sms, partition_size)

    meta = _kernel_meta(q, k_cache, num_heads // num_kv_heads, partition_size)
    meta["HAS_TREE"] = remap is not None
    meta["WINDOWED"] = window > 0
    tree = (seq_lens, seq_lens) if bases is None or remap is None else (bases, remap)
    inputs = (q, k_cache, v_cache, block_tables, seq_lens)
    input_strides = (
        *q.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        0 if remap is None else remap.stride(0),
    )
    qk_scale = scale * _LOG2E
    if window < 0:
        raise ValueError(f"window {window} must be 0 (none) or a positive number of tokens")
    if not split:
        out_strides = (*out.stride()[:2], 0, 0, 0)
        grid = (num_seqs, num_kv_heads, 1)
        args = (*inputs, out, out, *tree, qk_scale, window, *input_strides, *out_strides)
        _decode_kernel[grid](*args, IS_SPLIT=False, **meta)
        return out
    num_parts = num_partitions(max_context_len, partition_size)
    if workspace is None:
        workspace = DecodeWorkspace.allocate(
            num_seqs, num_heads, head_dim, max_context_len, q.device, partition_size
        )
    workspace.check_fits(num_seqs, num_heads, head_dim, num_parts)
    partial_out, partial_lse = workspace.partial_out, workspace.partial_lse
    partial_strides = (*partial_out.stride()[:3], *partial_lse.stride()[:2])
    grid = (num_seqs, num_kv_heads, num_parts)
    _decode_kernel[grid](
        *inputs,
        partial_out,
        partial_lse,
        *tree,
        qk_scale,
        window,
        *input_strides,
        *partial_strides,
        IS_SPLIT=True,
        **meta,
    )
    _merge_partitions_kernel[(num_seqs, num_heads)](
        partial_out,
        partial_lse,
        seq_lens,
        out,
        *partial_strides,
        *out.stride()[:2],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=meta["HEAD_DIM_PAD"],
        PARTITION_SIZE=partition_size,
        NUM_PARTS_PAD=triton.next_power_of_2(num_parts),
        num_warps=4,
    )
    return out


def _kernel_meta(
    q: torch.Tensor, k_cache: torch.Tensor, group_size: int, partition_size: int
) -> dict:
    """The decode kernel's compile-time parameters for these shapes and dtypes."""
    block_size, head_dim = k_cache.shape[1], q.shape[2]
    is_fp8 = k_cache.dtype == KV_FP8
    block_n = min(_FP8_BLOCK_N if is_fp8 else _BLOCK_N, partition_size)
    if partition_size % block_n or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"partition_size {partition_size} must be a power of two >= 16")
    return dict(
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        GROUP_SIZE=group_size,
        GROUP_PAD=max(_MIN_DOT_ROWS, triton.next_power_of_2(group_size)),
        BLOCK_N=block_n,
        PARTITION_SIZE=partition_size,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP16_DOT=is_fp8 and q.dtype != torch.float32,
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
    )


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Plain-torch definition of `paged_decode_attention`: gather pages, masked fp32 softmax."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_heads // num_kv_heads
    positions = torch.arange(block_tables.shape[1] * block_size, device=q.device)
    is_valid = positions[None, :] < seq_lens[:, None].long()  # [num_seqs, T]
    if window:
        is_valid &= positions[None, :] >= seq_lens[:, None].long() - window
    # unused table entries may hold anything: point them at page 0 before gathering
    pages = torch.where(is_valid, block_tables.long()[:, positions // block_size], 0)
    slots = positions % block_size
    # k, v: [num_seqs, T, num_kv_heads, head_dim]; masked positions zeroed so stale or NaN
    # slots cannot leak through 0 * NaN
    # the caches in q's dtype (an fp8 cache's values read as the kernel reads them), then fp32
    k = k_cache.to(q.dtype).float()[pages, slots].masked_fill(~is_valid[:, :, None, None], 0.0)
    v = v_cache.to(q.dtype).float()[pages, slots].masked_fill(~is_valid[:, :, None, None], 0.0)
    q_groups = q.float().view(num_seqs, num_kv_heads, group_size, head_dim)
    scores = torch.einsum("skgd,stkd->skgt", q_groups, k) * scale
    scores = scores.masked_fill(~is_valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # seq_len 0: all -inf rows
    result = torch.einsum("skgt,stkd->skgd", probs, v).reshape(num_seqs, num_heads, head_dim)
    if out is None:
        return result.to(q.dtype)
    return out.copy_(result)
