"""A GGUF matrix's quantized blocks in the forms the CPU's C kernels multiply, exactly: each weight
the float32 value `gguf.quants.dequantize` gives (one rounding, as ggml's own arithmetic).

Every type read here is, per group of 32 inputs, int8 codes q with a float32 scale s and offset
o for each half of 16: w = q * s + o, where q * s is exact in float32 (s is an fp16 times a
small integer, q at most 8 bits) and the kernels' fused multiply-add rounds once, as gguf's
`d * q - dm` (or `d * q`) does. The four forms the kernels take (`cpu/kernels.c`), each type
in the smallest that holds it and a fused matrix's parts in the smallest that holds them all:

* `q4_1` (24 bytes): float32 d and m, 16 bytes of codes 0..15 (input j low nibble, 16 + j
  high): w = q * d + m. Q4_1 as shipped; Q4_K's sub-blocks of 32, with d = d * sc and
  m = -(dmin * min), each an exact float32 product (fp16 times a 6-bit integer).
* `q5_0` (28 bytes): float32 d and m = -16 d, the codes' fifth bits (bit j: input j), then
  their low four as `q4_1`'s: w = q * d + m, exact. Q5_0, its fp16 d widened.
* `q8_0` (34 bytes): fp16 d, 32 int8: w = q * d. Q8_0 as shipped; Q4_0's codes - 8; Q5_0's
  codes - 16 where a fused matrix has Q8_0 parts too.
* `q8_16` (48 bytes): float32 (s, o) of inputs 0..15, then of 16..31, then 32 int8: Q6_K
  (scale d * sc per 16, exact: fp16 times int8, offset 0), Q5_1 (d and m), Q5_K (Q4_K's
  scales and offsets over five-bit codes), Q3_K (d * (sc - 32) per 16 over codes -4..3), Q2_K
  (d * sc and -(dmin * m) per 16 over codes 0..3), and any of the above where a fused matrix
  (qkv, gate_up) has parts of two forms.

Other types (IQ*, TQ*, ...) have no form here: they are dequantized to float32.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

GROUP = 32
# each type read here: the kernels' forms that hold it exactly, smallest first
HELD_BY = {
    T.Q2_K: ("q8_16",),
    T.Q3_K: ("q8_16",),
    T.Q4_0: ("q8_0", "q8_16"),
    T.Q4_1: ("q4_1", "q8_16"),
    T.Q4_K: ("q4_1", "q8_16"),
    T.Q5_0: ("q5_0", "q8_0", "q8_16"),
    T.Q5_1: ("q8_16",),
    T.Q5_K: ("q8_16",),
    T.Q8_0: ("q8_0", "q8_16"),
    T.Q6_K: ("q8_16",),
}


@attrs.frozen
class Groups:
    """A matrix as groups of 32 inputs: codes [N, G, 32] int8 (Q4's 0..15 among them), scales
    and offsets [N, G, 2] float32 (inputs 0..15, 16..31): w = q * s + o."""

    codes: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray


def form_of(qtype: T) -> str | None:
    """The smallest of the kernels' forms a matrix of `qtype` converts to exactly, or None
    (dequantized)."""
    forms = HELD_BY.get(qtype)
    return forms[0] if forms else None


def common_form(qtypes: list[T]) -> str | None:
    """The smallest form that holds every part (in `qtypes`) of a fused matrix exactly (q8_16
    holds every type read here); None when any part has no form."""
    if not qtypes or any(t not in HELD_BY for t in qtypes):
        return None
    return next(f for f in HELD_BY[qtypes[0]] if all(f in HELD_BY[t] for t in qtypes))


def block_rows(data: np.ndarray, qtype: T, form: str) -> torch.Tensor:
    """A GGUF matrix's data ([N, bytes a row] uint8, as `GGUFReader` gives it) of `qtype` in
    `form`'s rows ([N, K / 32 * the form's bytes] uint8)."""
    raw = np.asarray(data, dtype=np.uint8)
    groups = unpack(raw, qtype)
    return torch.from_numpy(np.ascontiguousarray(_PACK[form](groups)).reshape(raw.shape[0], -1))


def unpack(raw: np.ndarray, qtype: T) -> Groups:
    """[N, bytes a row] of `qtype`'s blocks as `Groups`, in the order gguf dequantizes them."""
    from gguf.constants import GGML_QUANT_SIZES

    if qtype not in HELD_BY:
        raise ValueError(f"{qtype.name} blocks have no form for the CPU kernels")
    _, size = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, size)
    codes, scales, offsets = _UNPACK[qtype](blocks)
    n = raw.shape[0]
    return Groups(
        codes.reshape(n, -1, GROUP).astype(np.int8),
        scales.reshape(n, -1, 2).astype(np.float32),
        offsets.reshape(n, -1, 2).astype(np.float32),
    )


def _half(b: np.ndarray) -> np.ndarray:
    """fp16 bytes [n, 2] -> float32 [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _halves(x: np.ndarray) -> np.ndarray:
    """One value a group [n, G] -> one a half [n, G, 2]."""
    return np.repeat(x[..., None], 2, axis=-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes a group [..., 16] -> codes [..., 32]: the low nibbles first, then the high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_1(b: np.ndarray):
    d, m = _half(b[:, 0:2]), _half(b[:, 2:4])
    return _nibbles(b[:, 4:]), _halves(d), _halves(m)


def _q8_0(b: np.ndarray):
    d = _half(b[:, 0:2])
    return b[:, 2:].view(np.int8), _halves(d), np.zeros((len(b), 1, 2), np.float32)


def _q4_0(b: np.ndarray):
    d = _half(b[:, 0:2])
    codes = _nibbles(b[:, 2:]).astype(np.int8) - 8
    return codes, _halves(d), np.zeros((len(b), 1, 2), np.float32)


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0's and Q5_1's codes 0..31: 4 bytes of fifth bits (bit j: input j), then 16 of
    nibbles."""
    bits = np.ascontiguousarray(qh).view(np.uint32)
    high = ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _nibbles(qs) | high << 4


def _q5_0(b: np.ndarray):
    d = _half(b[:, 0:2])
    codes = _five_bits(b[:, 2:6], b[:, 6:22]).astype(np.int8) - 16
    return codes, _halves(d), np.zeros((len(b), 1, 2), np.float32)


def _q5_1(b: np.ndarray):
    d, m = _half(b[:, 0:2]), _half(b[:, 2:4])
    return _five_bits(b[:, 4:8], b[:, 8:24]), _halves(d), _halves(m)


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's twelve bytes of eight 6-bit scales and mins -> [n, 8] each (ggml's
    `get_scale_min_k4`)."""
    d, m, m_d = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mins


def _q4_k(b: np.ndarray):
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    sc, mins = _q4_k_scales(b[:, 4:16])
    # [n, 4, 32] bytes: chunk j's low nibbles are sub-block 2j, its high ones 2j + 1
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    codes = qs & 0x0F
    return codes, _halves(d * sc), _halves(-(dmin * mins))


def _q5_k(b: np.ndarray):
    """Q4_K's layout with a fifth bit: sub-block s's codes take bit s of the 32 bytes qh."""
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    sc, mins = _q4_k_scales(b[:, 4:16])
    qs = b[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    codes = (qs & 0x0F).reshape(-1, 8, 32) | high << 4
    return codes, _halves(d * sc), _halves(-(dmin * mins))


def _two_bits(qs: np.ndarray) -> np.ndarray:
    """Q2_K's and Q3_K's 64 bytes of 2-bit codes -> [n, 16, 16], sub-block s = 8 h + 2 j + p:
    bits 2 j of bytes 32 h + 16 p + l."""
    shifted = qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return (shifted & 0x03).reshape(-1, 16, 16)


def _q2_k(b: np.ndarray):
    """Sub-blocks of 16: a byte each of 4-bit scale (low) and min (high), d and dmin fp16."""
    sc, d, dmin = b[:, :16], _half(b[:, 80:82]), _half(b[:, 82:84])
    scales, mins = d * (sc & 0x0F), dmin * (sc >> 4)
    return _two_bits(b[:, 16:80]), scales, -mins


def _q3_k(b: np.ndarray):
    """Sub-blocks of 16: 2-bit codes less 4 where their bit of the 32 hmask bytes is clear,
    sixteen 6-bit scales (low nibbles in bytes 0..7, their top two bits in 8..11) less 32."""
    hmask, sc, d = b[:, :32], b[:, 96:108], _half(b[:, 108:110])
    high = (hmask.reshape(-1, 1, 2, 16) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1, 1)) & 1
    codes = _two_bits(b[:, 32:96]).astype(np.int8) - ((1 - high) << 2).reshape(-1, 16, 16)
    low = np.concatenate([sc[:, :8] & 0x0F, sc[:, :8] >> 4], axis=-1)
    top = sc[:, 8:12].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)
    six = (low | (top.reshape(-1, 16) & 0x03) << 4).astype(np.int16) - 32
    return codes, d * six, np.zeros((len(b), 16), np.float32)


def _q6_k(b: np.ndarray):
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _half(b[:, 208:])
    low = ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    high = qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    six_bits = (low & 0x0F).reshape(-1, 8, 32) | (high & 0x03).reshape(-1, 8, 32) << 4
    return six_bits.astype(np.int8) - 32, d * sc, np.zeros((len(b), 16), np.float32)


_UNPACK = {
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q4_K: _q4_k,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q5_K: _q5_k,
    T.Q8_0: _q8_0,
    T.Q6_K: _q6_k,
}


def _pack_q4_1(g: Groups) -> np.ndarray:
    codes = g.codes.view(np.uint8)
    nibbles = codes[..., :16] | codes[..., 16:] << 4
    dm = np.stack([g.scales[..., 0], g.offsets[..., 0]], axis=-1)
    return np.concatenate([dm.view(np.uint8), nibbles], axis=-1)


def _pack_q5_0(g: Groups) -> np.ndarray:
    codes = (g.codes.astype(np.int16) + 16).astype(np.uint8)  # 0..31
    nibbles = (codes[..., :16] & 0x0F) | (codes[..., 16:] & 0x0F) << 4
    fifth = ((codes >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(-1)
    d = g.scales[..., 0]
    dm = np.stack([d, -16 * d], axis=-1)  # -16 d: exact
    bits = fifth.astype("<u4")[..., None].view(np.uint8)
    return np.concatenate([dm.view(np.uint8), bits, nibbles], axis=-1)


def _pack_q8_0(g: Groups) -> np.ndarray:
    d = g.scales[..., :1].astype(np.float16)  # the file's fp16, exactly
    return np.concatenate([d.view(np.uint8), g.codes.view(np.uint8)], axis=-1)


def _pack_q8_16(g: Groups) -> np.ndarray:
    so = np.stack([g.scales, g.offsets], axis=-1).reshape(*g.scales.shape[:2], 4)
    return np.concatenate([so.view(np.uint8), g.codes.view(np.uint8)], axis=-1)


_PACK = {"q4_1": _pack_q4_1, "q5_0": _pack_q5_0, "q8_0": _pack_q8_0, "q8_16": _pack_q8_16}
