"""llama.cpp's k-quants written from float32 in numpy: Q4_K, Q5_K and Q6_K blocks, byte for byte
in the layout `ggml-common.h` defines (and the `gguf` package dequantizes), so that tests and
tools can make k-quant GGUF files (`gguf.quants.quantize` cannot: it raises for these types).

Each row is cut into super-blocks of 256 values:
* Q4_K (144 bytes): fp16 `d` and `dmin`, eight 6-bit scales and eight 6-bit mins packed in 12
  bytes, then 4-bit codes of eight sub-blocks of 32; a value is `d*sc*q - dmin*m`.
* Q5_K (176 bytes): as Q4_K, with each code's fifth bit in 32 bytes (`qh`) before the nibbles.
* Q6_K (210 bytes): 6-bit codes (low nibbles, then the two high bits), sixteen int8 scales of
  sub-blocks of 16, fp16 `d`; a value is `d*sc*(q - 32)`.

The scales here are plain min/max ones (each sub-block's range over its levels, rounded up to
the super-block's 6- or 8-bit grid), not llama.cpp's searched ones (`make_qkx2_quants` tries
several scales and keeps the least squared error), so its error is a little larger than
llama.cpp's; the format is the same and any ggml reader reads these blocks.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_F16_UP = 1 + 2.0**-10  # a scale widened by one fp16 ulp: its fp16 rounding never narrows it


def quantize(array: np.ndarray, qtype: str) -> np.ndarray:
    """`array` ([..., columns], columns a multiple of 256) in `qtype`'s blocks: uint8
    [..., columns / 256 * block bytes], the shape `gguf.quants.quantize` returns."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"{qtype} is not a k-quant this writer makes ({', '.join(BLOCK_BYTES)})")
    if array.shape[-1] % QK_K:
        raise ValueError(f"rows of {array.shape[-1]} values: k-quants need a multiple of {QK_K}")
    blocks = np.asarray(array, dtype=np.float32).reshape(-1, QK_K)
    packed = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}[qtype](blocks)
    return packed.reshape(*array.shape[:-1], array.shape[-1] // QK_K * BLOCK_BYTES[qtype])


def _fp16(x: np.ndarray) -> np.ndarray:
    """Scales as the fp16 the block stores, widened first so that the stored one is not less."""
    return (x * _F16_UP).astype(np.float16)


def _grid(values: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative per-sub-block `values` [n, s] on a super-block grid: the fp16 step [n, 1]
    and integer multiples of it in 0..`top`, rounded up (a scale) so none is narrowed."""
    step = _fp16(values.max(axis=1, keepdims=True) / top)
    wide = step.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        units = np.where(wide > 0, np.ceil(values / wide), 0)
    return step, np.clip(units, 0, top).astype(np.uint8)


def _affine(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K's and Q5_K's shared half: per sub-block of 32 a scale and a min (the min at most 0,
    stored as its negation) on 6-bit grids, and codes 0..`levels`-1 [n, 8, 32]."""
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=2), 0)
    d, sc = _grid((sub.max(axis=2) - low) / (levels - 1), 63)
    dmin, m = _grid(-low, 63)
    scale = d.astype(np.float32) * sc
    offset = dmin.astype(np.float32) * m
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[..., None] > 0, (sub + offset[..., None]) / scale[..., None], 0)
    codes = np.clip(np.rint(q), 0, levels - 1).astype(np.uint8)
    return d, dmin, pack_scales_mins(sc, m), codes


def pack_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit mins [n, 8] in llama.cpp's 12 bytes: bytes 0-3 and
    4-7 hold scales and mins 0-3 in their low 6 bits and bits 4-5 of scales and mins 4-7 in
    their top 2; bytes 8-11 the low nibbles of scales 4-7 (low) and mins 4-7 (high)."""
    packed = np.empty((sc.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    packed[:, 4:8] = m[:, :4] | (m[:, 4:] >> 4) << 6
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | (m[:, 4:] & 0x0F) << 4
    return packed


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """Low 4 bits of codes [n, 8, 32] in 128 bytes: sub-blocks 2j and 2j+1 share bytes 32j..,
    the even one in the low nibble."""
    low = codes & 0x0F
    return (low[:, 0::2] | low[:, 1::2] << 4).reshape(-1, 128)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, codes = _affine(blocks, 16)
    return np.concatenate([_bytes(d), _bytes(dmin), scales, _nibbles(codes)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, codes = _affine(blocks, 32)
    fifth = (codes >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(fifth, axis=1)  # byte l: sub-block i's value l in bit i
    return np.concatenate([_bytes(d), _bytes(dmin), scales, qh, _nibbles(codes)], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16, 16)
    d, sc = _grid(np.abs(sub).max(axis=2) / 31, 127)
    scale = d.astype(np.float32) * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[..., None] > 0, sub / scale[..., None], 0)
    codes = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    # each half of 128 values: chunks of 32 c=0..3; chunk c's low nibbles in bytes
    # 32*(c%2).. (high nibble for c >= 2), its high two bits at bits 2c of bytes 0..31
    low = codes & 0x0F
    ql = (low[:, :, 0:2] | low[:, :, 2:4] << 4).reshape(-1, 128)
    high = (codes >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    qh = np.bitwise_or.reduce(high, axis=2).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _bytes(d)], axis=1)


def _bytes(half: np.ndarray) -> np.ndarray:
    """fp16 [n, 1] as its two little-endian bytes [n, 2]."""
    return half.astype("<f2").view(np.uint8).reshape(-1, 2)


def q4_k_m_type(name: str, num_layers: int, has_output: bool = True) -> str:
    """The type llama.cpp's Q4_K_M gives a matrix named `name` (its `llama_tensor_get_type`,
    without its architecture-specific exceptions): Q6_K for the output head (the embedding
    where the head is tied to it) and for `attn_v` and `ffn_down` in the layers
    `use_more_bits` picks (the first and last eighth, and every third between), Q4_K else."""
    if name == "output.weight" or (not has_output and name == "token_embd.weight"):
        return "Q6_K"
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down", "ffn_down_exps"):
        i, eighth = int(parts[1]), num_layers // 8
        if i < eighth or i >= 7 * num_layers // 8 or (i - eighth) % 3 == 2:
            return "Q6_K"
    return "Q4_K"
