"""The paged KV cache's storage: its element type, allocation, writes and reads.

One layer's cache is `[num_blocks, block_size, num_kv_heads, head_dim]`; a sequence's token at
position p lives at `cache[block_table[p // block_size], p % block_size]`. The cache holds the
model's dtype, or float8 e4m3 (`kv_cache_dtype="fp8"`): half the bytes of bf16, so twice the
pages and half the bytes a decode step's attention reads. fp8 values are stored unscaled and
saturate at +-448, its largest finite value: clamped before the conversion, as not every
conversion saturates (Triton's interpreter does not). Attention reads them back in the model's
dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KV_FP8 = torch.float8_e4m3fn
KV_FP8_MAX = 448.0


KvCaches = list[tuple[torch.Tensor, torch.Tensor]]  # each layer's (K, V) pages


def slot_of(table: Sequence[int], position: int, block_size: int) -> int:
    """The flat KV slot of `position` in a sequence whose pages are `table`."""
    return table[position // block_size] * block_size + position % block_size


def slots_for(table: Sequence[int], start: int, n: int, block_size: int) -> list[int]:
    """The flat KV slots of positions start..start+n-1, a page's run at a time."""
    out: list[int] = []
    position, stop = start, start + n
    while position < stop:
        page, offset = divmod(position, block_size)
        take = min(block_size - offset, stop - position)
        base = table[page] * block_size + offset
        out.extend(range(base, base + take))
        position += take
    return out


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for `EngineConfig.kv_cache_dtype`."""
    return KV_FP8 if name == "fp8" else model_dtype


def allocate(
    num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(k_cache, v_cache) per layer, zeroed."""
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it."""
    if dtype == KV_FP8:
        x = x.clamp(-KV_FP8_MAX, KV_FP8_MAX)
    return x.to(dtype)


def _raw(t: torch.Tensor) -> torch.Tensor:
    # torch's CPU index kernels have no float8 version: fp8 values move as their bytes
    return t.view(torch.uint8) if t.dtype == KV_FP8 else t


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """k, v: [T, KVH, D] into flat slots `slots` ([T]) of the caches."""
    kvh, d = k_cache.shape[-2:]
    _raw(k_cache).view(-1, kvh, d).index_copy_(0, slots, _raw(to_cache(k, k_cache.dtype)))
    _raw(v_cache).view(-1, kvh, d).index_copy_(0, slots, _raw(to_cache(v, v_cache.dtype)))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pages of `block_tables` ([B, NB]) as [B, KVH, NB * BS, D] of `dtype`."""
    b, nb = block_tables.shape
    # index_select: ~5x faster than cache[block_tables]
    pages = _raw(cache).index_select(0, block_tables.flatten()).view(cache.dtype).to(dtype)
    return pages.reshape(b, nb * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def gather_slots(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache's flat slots `slots` ([N]) as [N, KVH, D] of `dtype`."""
    kvh, d = cache.shape[-2:]
    return _raw(cache).view(-1, kvh, d).index_select(0, slots).view(cache.dtype).to(dtype)


def move_slots(kv_caches: KvCaches, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Every layer's K/V rows at flat slots `src` ([N]) copied to slots `dst` ([N]): a draft
    tree's accepted path moved to the positions it now holds (read before any is written)."""
    for k_cache, v_cache in kv_caches:
        for cache in (k_cache, v_cache):
            kvh, d = cache.shape[-2:]
            flat = _raw(cache).view(-1, kvh, d)
            flat.index_copy_(0, dst, flat.index_select(0, src))
