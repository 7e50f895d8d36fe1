"""A mixture-of-experts layer on CUDA: the experts as grouped GEMMs in Triton, graph-capturable.

Each token's top-k (expert, weight) pairs are its k entries, entry j = token j // k, slot j % k.
`sort_by_expert` orders the entries by expert and pads each expert's run to a multiple of the
tile height, into a buffer of a bound fixed by the shapes (k T + E (M - 1), rounded up to M):
no count comes back to the host, so a CUDA graph captures it. `_grouped_kernel` then runs one
program per (tile of M entries, block of output columns): the tile's expert is read from
`block_experts`, its rows are gathered by entry, and a tile past the last expert's run exits at
once, so an expert no token chose reads none of its weights. The layer is gate_up, the gated
activation, down scaled by each entry's routing weight, and the sum of a token's k rows.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from memstep.executors.cuda.kernels.activation import gated_product
from memstep.executors.model.layers.block import Experts
from memstep.executors.model.layers.mlp import route

_BLOCK_N = 64
_BLOCK_K = 64
_SMALL_M, _LARGE_M = 16, 64  # tile heights: decode's few entries an expert, a prefill's many


@attrs.frozen
class SortedEntries:
    rows: torch.Tensor  # [bound] int64 entry of each row, expert by expert; padding: k T
    block_experts: torch.Tensor  # [bound / block_m] int64 expert of each tile; past the end: E
    counts: torch.Tensor  # [E] int64 entries each expert got
    block_m: int


def tile_height(num_entries: int, num_experts: int) -> int:
    """The tile height for k T entries over E experts: 16 while experts average a tile or less
    (decode), 64 beyond (a prefill's runs), from the shapes alone."""
    return _SMALL_M if num_entries <= _SMALL_M * num_experts else _LARGE_M


def sort_by_expert(chosen: torch.Tensor, num_experts: int, block_m: int) -> SortedEntries:
    """chosen: [T, k] expert ids -> the entries sorted by expert, each expert's run padded to a
    multiple of `block_m`. Device ops only (no host sync): capturable."""
    flat = chosen.flatten()
    n, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # entries grouped by expert, in entry order
    by_expert = flat[order]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[by_expert]
    bound = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    rows = torch.full((bound,), n, dtype=torch.int64, device=device)
    rows.scatter_(0, (ends - padded)[by_expert] + rank, order)
    starts = torch.arange(0, bound, block_m, device=device)
    block_experts = torch.searchsorted(ends, starts, right=True)
    return SortedEntries(rows, block_experts, counts, block_m)


@triton.jit
def _grouped_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,
    block_experts_ptr,
    scales_ptr,
    num_entries,
    num_experts,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_wk,
    stride_out,
    A_ROW_DIV: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (bound / BLOCK_M, cdiv(N, BLOCK_N)): out[entry] = a[entry // A_ROW_DIV] @ W[e]^T
    for the tile's entries (times scales[entry] with SCALED); W: [E, N, K]."""
    tile = tl.program_id(0)
    expert = tl.load(block_experts_ptr + tile)
    if expert >= num_experts:  # past the last expert's run: no rows, no weights read
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    entries = tl.load(rows_ptr + offs_m)
    is_row = entries < num_entries
    a_rows = tl.where(is_row, entries // A_ROW_DIV, 0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_a + ks[None, :],
            mask=is_row[:, None] & mask_k[None, :],
            other=0.0,
        )
        w = tl.load(
            w_expert + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk,
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if SCALED:
        acc = acc * tl.load(scales_ptr + entries, mask=is_row, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + entries[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & mask_n[None, :])


def grouped_matmul(
    a: torch.Tensor,
    weights: torch.Tensor,
    entries: SortedEntries,
    num_entries: int,
    a_row_div: int,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """[num_entries, N]: entry j's row is a[j // a_row_div] @ weights[its expert]^T, times
    scales[j] where given. a: [R, K] with unit column stride; weights: [E, N, K]."""
    num_experts, n, k = weights.shape
    if a.shape[1] != k or a.stride(1) != 1:
        raise ValueError(f"a {tuple(a.shape)} needs {k} columns of unit stride")
    out = torch.empty(num_entries, n, dtype=a.dtype, device=a.device)
    if num_entries == 0:
        return out
    grid = (entries.block_experts.numel(), triton.cdiv(n, _BLOCK_N))
    _grouped_kernel[grid](
        a,
        weights,
        out,
        entries.rows,
        entries.block_experts,
        out if scales is None else scales,
        num_entries,
        num_experts,
        n,
        k,
        a.stride(0),
        *weights.stride(),
        out.stride(0),
        A_ROW_DIV=a_row_div,
        SCALED=scales is not None,
        BLOCK_M=entries.block_m,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )
    return out


def fused_moe(x: torch.Tensor, experts: Experts, activation: str) -> torch.Tensor:
    """[T, hidden] -> [T, hidden]: the router's top k (torch), the entries sorted by expert,
    gate_up and down as grouped GEMMs, each entry's down row scaled by its weight, and a
    token's k rows summed. Allocates only within the call and never syncs: capturable."""
    t, top_k = x.shape[0], experts.top_k
    weights, chosen = route(x, experts)  # [T, k] each
    num_experts = experts.router.shape[0]
    entries = sort_by_expert(chosen, num_experts, tile_height(t * top_k, num_experts))
    gate_up = grouped_matmul(x, experts.gate_up, entries, t * top_k, top_k)
    hidden = gated_product(gate_up, activation)  # [T k, expert width]
    down = grouped_matmul(hidden, experts.down, entries, t * top_k, 1, weights.flatten())
    return down.view(t, top_k, x.shape[1]).sum(dim=1)


def experts_hit(x: torch.Tensor, experts: Experts) -> int:
    """How many distinct experts the rows of `x` route to (what a step reads of the layer's
    expert weights); syncs with the host: for measurements, never inside a step."""
    _, chosen = route(x, experts)
    return int(chosen.unique().numel())
