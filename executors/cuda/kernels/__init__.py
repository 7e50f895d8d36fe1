"""Triton kernels for the decode path: paged GQA attention (with sliding windows), (fused add +)
RMSNorm, rotary + KV write, the gated MLP's act(gate) * up, and the experts' grouped GEMMs.

Each kernel has a plain-torch `*_reference` with the same signature, used by the tests.
Without the triton extra installed only `triton_available()` is exported.

Triton decides when a kernel module is imported whether its kernels run compiled or
interpreted: set TRITON_INTERPRET=1 before importing this package to run them on the CPU.
"""

import os

import torch

try:
    import triton  # noqa: F401
except ImportError:
    _HAS_TRITON = False
else:
    _HAS_TRITON = True
    from memstep.executors.cuda.kernels.activation import (
        gated_product,
        silu_mul,
        silu_mul_reference,
    )
    from memstep.executors.cuda.kernels.fused_moe import fused_moe
    from memstep.executors.cuda.kernels.paged_attention import (
        DecodeWorkspace,
        paged_attention_reference,
        paged_decode_attention,
        use_split_k,
    )
    from memstep.executors.cuda.kernels.rmsnorm import (
        fused_add_rmsnorm,
        fused_add_rmsnorm_reference,
        rmsnorm,
        rmsnorm_reference,
    )
    from memstep.executors.cuda.kernels.rope_kv import (
        rope_and_write_kv,
        rope_and_write_kv_reference,
    )

__all__ = [
    "DecodeWorkspace",
    "fused_add_rmsnorm",
    "fused_add_rmsnorm_reference",
    "fused_moe",
    "gated_product",
    "paged_attention_reference",
    "paged_decode_attention",
    "rmsnorm",
    "rmsnorm_reference",
    "rope_and_write_kv",
    "rope_and_write_kv_reference",
    "silu_mul",
    "silu_mul_reference",
    "triton_available",
    "use_split_k",
]


def triton_available() -> bool:
    """True when Triton imports and its kernels can run: on a CUDA device, or interpreted on
    the CPU under TRITON_INTERPRET=1."""
    return _HAS_TRITON and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
