"""RMSNorm and the fused residual-add + RMSNorm that opens every Llama decoder sub-layer.

Rounding follows Hugging Face's LlamaRMSNorm: the sum of squares is taken in fp32, the
normalised row is rounded to the normed tensor's dtype, then multiplied by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (num_rows,): one program normalises one row held whole in registers."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + row * stride_residual + offs
        residual = tl.load(residual_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual.dtype)
        tl.store(residual_ptrs, x, mask=mask)
    x_f32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x_f32 * x_f32, 0) / hidden_size + eps)
    normed = (x_f32 * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = (normed * weight).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + offs, out, mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
) -> torch.Tensor:
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden_size}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of shape {tuple(x.shape)}")
    x_rows = x.reshape(-1, hidden_size)  # [num_rows, hidden_size], a view where it can be
    if x_rows.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("x rows and weight must be contiguous")
    out_rows = out.view(-1, hidden_size)
    residual_rows = x_rows if residual is None else residual.view(-1, hidden_size)
    num_rows = x_rows.shape[0]
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(hidden_size)
    _rmsnorm_kernel[(num_rows,)](
        x_rows,
        residual_rows,
        weight,
        out_rows,
        x_rows.stride(0),
        residual_rows.stride(0),
        out_rows.stride(0),
        hidden_size,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
    )
    return out


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim of x ([..., hidden_size]). Writes and returns out
    (allocated like x when None)."""
    return _launch(x, None, weight, eps, out)


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual += x in place (residual must be contiguous, same shape as x), then returns
    RMSNorm(residual) written to out (allocated like x when None)."""
    if residual.shape != x.shape or not residual.is_contiguous():
        raise ValueError(f"residual must be a contiguous tensor of shape {tuple(x.shape)}")
    return _launch(x, residual, weight, eps, out)


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain-torch `rmsnorm` (Hugging Face LlamaRMSNorm)."""
    x_f32 = x.float()
    normed = x_f32 * torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + eps)
    result = weight * normed.to(x.dtype)
    if out is None:
        return result.to(x.dtype)
    return out.copy_(result)


def fused_add_rmsnorm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch `fused_add_rmsnorm`: also adds x into residual in place."""
    residual.add_(x)
    result = rmsnorm_reference(residual, weight, eps)
    if out is None:
        return result.to(x.dtype)
    return out.copy_(result)
