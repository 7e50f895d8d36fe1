"""Where the model's backend is chosen: once, from the device, before the model is built."""

from __future__ import annotations

import torch

from memstep.core.model_config import ModelConfig
from memstep.executors.model.llama import Backend


def pick_backend(
    device: torch.device,
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    kv_dtype: torch.dtype,
    one_rank: bool = True,
    bf16_products: bool = False,
    decode_attention: bool = True,
) -> Backend:
    """CUDA's Triton kernels on a GPU, the CPU's C kernels (where they apply) on the CPU.
    `decode_attention=False`: torch's attention for decode rows too (a draft model)."""
    if device.type == "cuda":  # imports Triton: never on a CPU-only path
        from memstep.executors.cuda.backend import CudaBackend, log_family_pieces
        from memstep.executors.cuda.kernels import paged_decode_attention

        log_family_pieces(cfg)
        return CudaBackend(paged_decode_attention if decode_attention else None, one_rank)
    from memstep.executors.cpu.backend import CpuBackend

    return CpuBackend.choose(cfg, weights, kv_dtype, one_rank, bf16_products, decode_attention)
