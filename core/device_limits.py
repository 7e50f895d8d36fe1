"""Batch limits that fit the device, for when the user gives none.

On CUDA, `max_num_seqs` and `max_num_batched_tokens` follow vLLM's per-GPU defaults for an
online server: 1,024 sequences and 8,192 tokens a step on a GPU of 70 GiB or more, 256 and
2,048 below that; fewer sequences when the KV cache left after the weights could not hold 256
tokens for each (a large model on a small GPU).  The CPU keeps the small defaults of
`EngineConfig` (16 and 512).  The resolved values are a separate value (`Limits`) that the
command line writes into the frozen config it builds, so the event log records them and a
replay, on any device, runs with the same limits.

The device's memory is read with `nvidia-smi` (the core imports no torch and must not start
CUDA in its own process); without it the CPU defaults apply.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import attrs

from memstep.core.config import EngineConfig
from memstep.core.model_config import ModelConfig

GIB = 1 << 30
LARGE_GPU_BYTES = 70 * GIB
MEMORY_FRACTION = 0.9  # the default gpu_memory_utilization
TOKENS_PER_SEQ = 256  # KV each running sequence should find, on average, at the default limit


@attrs.frozen
class Limits:
    max_num_seqs: int
    max_num_batched_tokens: int
    why: str  # how they were chosen, for the start-up log


def default_limits(
    device_bytes: int | None, model: ModelConfig | None, dtype_bytes: int = 2
) -> Limits:
    """The limits for a CUDA device of `device_bytes`, or the CPU's when that is None."""
    if device_bytes is None or model is None:
        d = EngineConfig()
        return Limits(d.max_num_seqs, d.max_num_batched_tokens, "cpu defaults")
    large = device_bytes >= LARGE_GPU_BYTES
    seqs, tokens = (1024, 8192) if large else (256, 2048)
    kv_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes
    free = device_bytes * MEMORY_FRACTION - model.num_params * dtype_bytes
    fit = int(max(free, 0) // (kv_per_token * TOKENS_PER_SEQ))
    if fit < seqs:
        seqs = max(16, 1 << max(fit, 1).bit_length() - 1)  # a power of two, at least 16
    why = f"cuda {device_bytes / GIB:.0f} GiB, {'>=' if large else '<'} 70 GiB; KV fits {fit} seqs"
    return Limits(seqs, tokens, why)


def cuda_device_bytes(device: str) -> int | None:
    """Total memory of the first visible GPU, or None on the CPU (or without nvidia-smi)."""
    smi = shutil.which("nvidia-smi")
    if device == "cpu" or smi is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    if not visible or visible == "-1":
        return None  # every GPU hidden
    cmd = [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", visible]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out.split()[0]) * (1 << 20)  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
