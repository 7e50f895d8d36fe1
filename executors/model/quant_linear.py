"""Weight-only quantized linears for the CPU, kept in the weights dict as plain tensors.

Two forms:

* q4: the rows of a GGUF's blocks, multiplied in float32 by the CPU backend's C kernels:
  `NAME.q4_1` ([N, K / 32 * 24] uint8: groups of 32 inputs, w = code * d + m, the file's fp16
  d and m widened to float32 at load) for the decoder's matrices, `lm_head.q8_0` ([V, K / 32 *
  34]: w = q * d, as the file holds it) for the head, the GGUF's Q8_0 embedding (4 bits would
  throw half of it away). The products are those of the float32 model on gguf's dequantized
  values up to float32 rounding, so greedy text stays with float32's
  (tests/executors/model/test_quant_quality.py); with matmul_precision "bfloat16" the decoder's
  products are of x and the weights rounded to bfloat16, summed in float32 (the head keeps
  float32's). A model without blocks (a Hugging Face folder, random:) is quantized into them
  here (`quantize_q4`, `quantize_q8_0`).
* int8: one symmetric scale per output row: `NAME.int8` ([N, K] int8), `NAME.int8_scales` ([N]),
  multiplied by torch's weight-only kernel, fast only on bfloat16 rows (float32 rows take a
  scalar path: 12 ms instead of 0.11 ms for SmolLM2's gate_up at one row, torch 2.13), so its
  scales are bfloat16 and a float32 model's rows are rounded to bfloat16 for the matmul; each
  matrix is checked against its float values when it is made (`verify`).

Keeping them as tensors lets the memory plan, the live-tensor meter and the draft model read
them like any other weight.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

GROUP = 32  # inputs per q4 group, as in GGUF's Q4_1
# the C kernels' block rows, `NAME.<form>` (cpu/kernels.py; a GGUF's other types converted to
# them by formats/gguf_blocks.py)
BLOCK_FORMS = ("q4_1", "q5_0", "q8_0", "q8_16")
GGUF_Q4_1_BLOCK = 20  # bytes of a Q4_1 block as the file holds it: fp16 d, fp16 m, 16 of codes
# |error| allowed per probe output, as a fraction of its bound (see `verify`): bfloat16 rounds
# scales, zeros and outputs to 2^-9 each
PROBE_TOLERANCE = 2**-6

Linear = Callable[[torch.Tensor], torch.Tensor]


class QuantizationError(RuntimeError):
    """A quantized matrix does not reproduce the float values it was made from."""


def block_rows(data: np.ndarray) -> torch.Tensor:
    """A GGUF matrix's data ([N, bytes a row]) as an owned uint8 tensor, as the file holds it."""
    return torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))


def q4_1_rows(data: np.ndarray) -> torch.Tensor:
    """A GGUF Q4_1 matrix's data ([N, K / 32 * 20] bytes: fp16 d, fp16 m, 16 bytes of codes a
    block) as the kernels take it ([N, K / 32 * 24]): d and m widened to float32, exactly, so
    that no matmul converts them again (Q4_BYTES in cpu/kernels.c)."""
    raw = np.asarray(data, dtype=np.uint8)
    blocks = raw.reshape(raw.shape[0], -1, GGUF_Q4_1_BLOCK)
    scales = blocks[..., :4].copy().view(np.float16).astype(np.float32)  # [N, G, 2]: d, m
    return _q4_blocks(torch.from_numpy(scales), torch.from_numpy(blocks[..., 4:].copy()))


def _q4_blocks(scales: torch.Tensor, nibbles: torch.Tensor) -> torch.Tensor:
    """Q4_1 rows from float32 (d, m) [N, G, 2] and codes [N, G, 16] uint8."""
    n = scales.shape[0]
    return torch.cat([scales.contiguous().view(torch.uint8), nibbles], -1).reshape(n, -1)


def quantize_q4(w: torch.Tensor) -> torch.Tensor:
    """Float [N, K] -> Q4_1 rows: each group's minimum m and range / 15 as d (both rounded to
    fp16, as a GGUF holds them), the codes rounded against those values."""
    groups = w.float().reshape(w.shape[0], -1, GROUP)
    m = groups.amin(-1).half().float()
    d = ((groups.amax(-1) - m) / 15).half().float()
    step = torch.where(d > 0, d, torch.ones_like(d))
    codes = torch.round((groups - m[..., None]) / step[..., None]).clamp(0, 15)
    codes = codes.to(torch.uint8)
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    return _q4_blocks(torch.stack([d, m], -1), nibbles)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """Float [N, K] -> Q8_0 rows: per group of 32, d = max |w| / 127 (fp16), q = round(w / d)."""
    groups = w.float().reshape(w.shape[0], -1, GROUP)
    d = (groups.abs().amax(-1) / 127).half()
    step = torch.where(d > 0, d.float(), torch.ones_like(d, dtype=torch.float32))
    q = torch.round(groups / step[..., None]).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    return torch.cat([d[..., None].view(torch.uint8), q], -1).reshape(w.shape[0], -1)


def quantize_int8(name: str, w: torch.Tensor) -> dict:
    """`NAME.int8` and `NAME.int8_scales`: w / scale rounded, scale = max |row| / 127."""
    scale = w.float().abs().amax(1).clamp(min=1e-12) / 127
    scale = scale.to(torch.bfloat16).float()  # the kernel's scale, so that rounding uses it
    codes = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {name + ".int8": codes, name + ".int8_scales": scale.to(torch.bfloat16)}


def is_quantized_part(name: str) -> bool:
    """Whether weight `name` is a quantized matrix's codes or scales (kept in their dtype)."""
    return name.rsplit(".", 1)[-1] in (*BLOCK_FORMS, "int8", "int8_scales")


def is_quantized(weights: dict[str, torch.Tensor], name: str) -> bool:
    return any(f"{name}.{suffix}" in weights for suffix in (*BLOCK_FORMS, "int8"))


def make_linear(weights: dict[str, torch.Tensor], name: str, dense: Callable = F.linear) -> Linear:
    """x [T, K] -> x @ W^T [T, N] for matrix `name`: its int8 form if it has one, else
    `dense(x, weights[name])`. Block rows (BLOCK_FORMS) are the CPU backend's
    (`executors/cpu/linear.py`)."""
    if any(f"{name}.{form}" in weights for form in BLOCK_FORMS):
        raise ValueError(f"{name}: quantized blocks are multiplied by the CPU backend only")
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


LAYER_MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")  # a dense layer's, by weights key


def layer_matrices(num_layers: int) -> list[str]:
    """The names of the decoder's matrices, as the weights dict holds them."""
    return [f"layers.{i}.{name}" for i in range(num_layers) for name in LAYER_MATRICES]


def quantize_weights(
    weights: dict[str, torch.Tensor], mode: str, num_layers: int
) -> dict[str, torch.Tensor]:
    """`weights` with each float decoder matrix (and the head) replaced by its `mode` form;
    matrices already quantized stay as they are. q4 keeps the head in Q8_0 blocks, int8 in
    int8. A tied head keeps the float embedding for the lookup beside its quantized copy."""
    out = dict(weights)
    for name in layer_matrices(num_layers):
        if not is_quantized(out, name):
            out |= _quantized(name, out.pop(name), mode)
    if is_quantized(out, "lm_head"):
        return out
    head = out.pop("lm_head") if "lm_head" in out else out["embed"]
    if mode == "q4":
        return out | {"lm_head.q8_0": quantize_q8_0(head)}
    return out | _quantized("lm_head", head, "int8")


def _quantized(name: str, w: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
    """Matrix `name` in `mode`'s form; int8 is checked against the values it stands for."""
    if mode == "q4":
        return {name + ".q4_1": quantize_q4(w)}
    made = quantize_int8(name, w)
    scales = made[name + ".int8_scales"].float()[:, None]
    verify(name, make_linear(made, name), float_probe_sums(made[name + ".int8"].float() * scales))
    return made
