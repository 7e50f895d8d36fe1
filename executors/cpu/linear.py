"""The CPU's matmuls: Q4_1 / Q5_0 / Q8_0 / Q8_16 block rows through the C kernels, and float32
matrices with more outputs than inputs through oneDNN."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from memstep.executors.cpu import kernels as cpu_kernels
from memstep.executors.model.quant_linear import Linear, make_linear

BLOCK_MM = {
    "q4_1": cpu_kernels.q4_1_mm,
    "q5_0": cpu_kernels.q5_0_mm,
    "q8_0": cpu_kernels.q8_0_mm,
    "q8_16": cpu_kernels.q8_16_mm,
}


def wide_dense(dtype: torch.dtype) -> Callable:
    """The matmul for float weights with more outputs than inputs (qkv, gate_up, the head).

    In float32, oneDNN reads those 1.3-1.8x faster than MKL's gemm from 1 to 64 rows (2 AVX2
    cores, SmolLM2 shapes); MKL stays faster for the narrow ones (wo, down)."""
    onednn = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if onednn is None or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return F.linear
    return lambda x, w: onednn(x, w, None, "none", [], "")


def cpu_linear(
    weights: dict[str, torch.Tensor], name: str, dense: Callable, bf16: bool = False
) -> Linear:
    """Matrix `name` as `make_linear` makes it, but block rows (`BLOCK_MM`) multiplied by
    the C kernels (`bf16`: x's rows and the weights rounded to bfloat16, the sums float32).

    Q4_1 runs through the kernel for every batch, prefills included: a row's bits are the same
    whatever it is computed with (a prompt's token as it decoded), so a request preempted and
    recomputed, or a server resumed from its log, gets the tokens of an uninterrupted run."""
    for form, mm in BLOCK_MM.items():
        if f"{name}.{form}" in weights:
            return _in_float32(functools.partial(mm, blocks=weights[f"{name}.{form}"], bf16=bf16))
    return make_linear(weights, name, dense)


def _in_float32(mm: Linear) -> Linear:
    def linear(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return mm(x)
        return mm(x.float()).to(x.dtype)

    return linear
