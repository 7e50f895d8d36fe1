"""The gated MLP's elementwise half: act(gate) * up over the fused gate_up projection, one launch;
act is SwiGLU's silu or GeGLU's tanh-approximated GELU (Gemma's).

Rounding follows torch eager on `F.silu(gate) * up` (and `F.gelu(gate, approximate="tanh") *
up`): the activation is rounded to the input dtype before the product, which is rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024
_ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def _gated_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out, width, BLOCK: tl.constexpr, GELU: tl.constexpr
):
    """Grid (num_rows, cdiv(width, BLOCK)); gate is columns [0, width), up [width, 2 width)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + width + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(u)) = g sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3)
        act = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))  # 2 sqrt(2 / pi)
    else:
        act = g / (1.0 + tl.exp(-g))
    out = (act.to(gate.dtype).to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + offs, out, mask=mask)


def gated_product(
    gate_up: torch.Tensor, activation: str = "silu", out: torch.Tensor | None = None
) -> torch.Tensor:
    """gate_up: [N, 2 I] -> act(gate_up[:, :I]) * gate_up[:, I:] as [N, I], written to out
    (allocated when None); `activation` is "silu" or "gelu_tanh"."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unknown MLP activation {activation!r}: the kernel has {_ACTIVATIONS}")
    num_rows, double = gate_up.shape
    width = double // 2
    if double % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} must be [N, 2 I] with unit stride")
    if out is None:
        out = torch.empty(num_rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if out.shape != (num_rows, width) or out.stride(1) != 1:
        raise ValueError(f"out must be [{num_rows}, {width}] with unit stride")
    if num_rows == 0:
        return out
    grid = (num_rows, triton.cdiv(width, _BLOCK))
    gelu = activation == "gelu_tanh"
    _gated_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), width, _BLOCK, gelu)
    return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's `gated_product`."""
    return gated_product(gate_up, "silu", out)


def silu_mul_reference(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch `silu_mul`."""
    gate, up = gate_up.chunk(2, dim=-1)
    result = torch.nn.functional.silu(gate) * up
    return result if out is None else out.copy_(result)
