"""Weight-only quantized linears for the CPU, kept in the weights dict as plain tensors.

Two forms, both multiplied by torch's CPU weight-only kernels:

* q4: 4-bit codes in groups of 32 inputs, a scale and a minimum per group (w = code * d + m),
  the layout of the shipped GGUF's Q4_1 matrices, whose codes are kept exactly as shipped.
  Stored as `NAME.int4` (torch's packed int4, [N, K/2] uint8) and `NAME.int4_scales`
  ([K/32, N, 2] bfloat16: d and the zero m + 8 d, as the kernel takes them).
* int8: one symmetric scale per output row: `NAME.int8` ([N, K] int8), `NAME.int8_scales` ([N]).

Keeping them as tensors lets the memory plan, the live-tensor meter and the draft model read
them like any other weight. torch 2.13's CPU kernels are fast only on bfloat16 rows (float32
rows take a scalar path: 12 ms instead of 0.11 ms for SmolLM2's gate_up at one row), so the
scales are bfloat16 and a float32 model's rows are rounded to bfloat16 for the matmul.
Every matrix is checked against its float values when it is made (`verify`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

GROUP = 32  # inputs per q4 group, as in GGUF's Q4_1
_Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of 32 nibbles
# |error| allowed per probe output, as a fraction of its bound (see `verify`): bfloat16 rounds
# scales, zeros and outputs to 2^-9 each
PROBE_TOLERANCE = 2**-6

Linear = Callable[[torch.Tensor], torch.Tensor]


class QuantizationError(RuntimeError):
    """A quantized matrix does not reproduce the float values it was made from."""


def q4_1_codes(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q4_1 matrix's rows ([N, K / 32 * 20] bytes) -> codes [N, K] uint8 and d, m
    [N, K / 32] float32; block i holds inputs 32 i.. (low nibbles first, then high ones)."""
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, _Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, -1)
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m)


def quantize_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float [N, K] -> codes, d, m as Q4_1 makes them: each group's minimum and range / 15."""
    groups = w.float().reshape(w.shape[0], -1, GROUP)
    m = groups.amin(-1)
    d = (groups.amax(-1) - m) / 15
    step = torch.where(d > 0, d, torch.ones_like(d))
    codes = torch.round((groups - m[..., None]) / step[..., None]).clamp(0, 15)
    return codes.to(torch.uint8).reshape(w.shape), d, m


def dequantize_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Float32 [N, K] with gguf's arithmetic (d * code + m), so equal to its dequantized load."""
    d_full, m_full = d.repeat_interleave(GROUP, 1), m.repeat_interleave(GROUP, 1)
    return d_full * codes.float() + m_full


def pack_q4(name: str, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> dict:
    """`NAME.int4` and `NAME.int4_scales` for `codes` ([N, K]) with per-group d and m."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    scales = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1)  # kernel: (code - 8) d + zero
    return {name + ".int4": packed, name + ".int4_scales": scales.to(torch.bfloat16).contiguous()}


def quantize_int8(name: str, w: torch.Tensor) -> dict:
    """`NAME.int8` and `NAME.int8_scales`: w / scale rounded, scale = max |row| / 127."""
    scale = w.float().abs().amax(1).clamp(min=1e-12) / 127
    scale = scale.to(torch.bfloat16).float()  # the kernel's scale, so that rounding uses it
    codes = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {name + ".int8": codes, name + ".int8_scales": scale.to(torch.bfloat16)}


def is_quantized_part(name: str) -> bool:
    """Whether weight `name` is a quantized matrix's codes or scales (kept in their dtype)."""
    return name.rsplit(".", 1)[-1] in ("int4", "int4_scales", "int8", "int8_scales")


def is_quantized(weights: dict[str, torch.Tensor], name: str) -> bool:
    return name + ".int4" in weights or name + ".int8" in weights


def make_linear(weights: dict[str, torch.Tensor], name: str, dense: Callable = F.linear) -> Linear:
    """x [T, K] -> x @ W^T [T, N] for matrix `name`: its quantized form if it has one, else
    `dense(x, weights[name])`."""
    if name + ".int4" in weights:
        packed, scales = weights[name + ".int4"], weights[name + ".int4_scales"]
        group = packed.shape[1] * 2 // scales.shape[0]
        int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        return _in_bf16(lambda x: int4_mm(x, packed, group, scales))
    if name + ".int8" in weights:
        codes, scales = weights[name + ".int8"], weights[name + ".int8_scales"]
        int8_mm = torch.ops.aten._weight_int8pack_mm
        return _in_bf16(lambda x: int8_mm(x, codes, scales))
    w = weights[name]
    return lambda x: dense(x, w)


def _in_bf16(mm: Linear) -> Linear:
    def linear(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            return mm(x)
        return mm(x.to(torch.bfloat16)).to(x.dtype)

    return linear


def _ramp() -> torch.Tensor:
    return (torch.arange(GROUP) + 1) / GROUP  # exact in bfloat16


def float_probe_sums(w: torch.Tensor) -> torch.Tensor:
    """[3, N, K / 32] for a float matrix: each group's sum, its ramp-weighted sum, its max |w|."""
    groups = w.float().reshape(w.shape[0], -1, GROUP)
    return torch.stack([groups.sum(-1), groups @ _ramp(), groups.abs().amax(-1)])


def q4_probe_sums(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """`float_probe_sums` of code * d + m without making the matrix (max |w| bounded above)."""
    groups = codes.reshape(codes.shape[0], -1, GROUP)
    ramp = _ramp()
    flat = d * groups.sum(-1, dtype=torch.int32) + GROUP * m
    ramped = d * (groups.to(torch.int32) * (ramp * GROUP).int()).sum(-1) / GROUP + ramp.sum() * m
    return torch.stack([flat, ramped, torch.maximum(m.abs(), (m + 15 * d).abs())])


@functools.lru_cache(maxsize=8)
def _probes(groups: int) -> torch.Tensor:
    """[2 G, 32 G] bfloat16: row g sums group g's inputs, row G + g ramps them."""
    eye = torch.eye(groups).repeat_interleave(GROUP, 1)  # [G, K]: 1 on group g's inputs
    probes = torch.stack([eye, eye * _ramp().repeat(groups)]).reshape(-1, groups * GROUP)
    return probes.to(torch.bfloat16)


def verify(name: str, linear: Linear, sums: torch.Tensor) -> None:
    """Raise QuantizationError unless `linear` reproduces the float matrix whose
    `float_probe_sums` are `sums`, on probes that sum each group of 32 inputs, flat and ramped:
    every group's scale and zero counts. Allowed: PROBE_TOLERANCE of the probe's sum times the
    group's largest |w| (bfloat16 rounding of the scale, of the zero, which lies within the
    group's range, and of the output)."""
    groups = sums.shape[2]
    got = linear(_probes(groups)).float().reshape(2, groups, -1).transpose(1, 2)
    weight = torch.tensor([GROUP, _ramp().sum().item()])[:, None, None]
    bound = PROBE_TOLERANCE * weight * sums[2] + 1e-6
    excess = ((got - sums[:2]).abs() / bound).max().item()
    if not excess <= 1.0:
        raise QuantizationError(
            f"{name}: quantized matrix is off its float values by {excess:.1f}x the tolerance"
        )


def layer_matrices(num_layers: int) -> list[str]:
    """The names of the decoder's matrices, as the weights dict holds them."""
    names = ("wqkv", "wo", "w_gate_up", "w_down")
    return [f"layers.{i}.{name}" for i in range(num_layers) for name in names]


def quantize_weights(
    weights: dict[str, torch.Tensor], mode: str, num_layers: int
) -> dict[str, torch.Tensor]:
    """`weights` with each float decoder matrix (and the head) replaced by its `mode` form;
    matrices already quantized stay as they are. q4 quantizes the head to int8: it is the
    GGUF's Q8_0 embedding, and 4 bits would throw half of it away. A tied head keeps the float
    embedding for the lookup beside its int8 copy."""
    out = dict(weights)
    for name in layer_matrices(num_layers):
        if not is_quantized(out, name):
            out |= _quantized(name, out.pop(name), mode)
    head = out.pop("lm_head") if "lm_head" in out else out["embed"]
    return out | _quantized("lm_head", head, "int8")


def _quantized(name: str, w: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
    """Matrix `name` in `mode`'s form, checked against the values it stands for."""
    if mode == "int8":
        made = quantize_int8(name, w)
        scales = made[name + ".int8_scales"].float()[:, None]
        sums = float_probe_sums(made[name + ".int8"].float() * scales)
    else:
        codes, d, m = quantize_q4(w)
        made, sums = pack_q4(name, codes, d, m), q4_probe_sums(codes, d, m)
    verify(name, make_linear(made, name), sums)
    return made
