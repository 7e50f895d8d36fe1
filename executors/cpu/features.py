"""What this CPU computes natively, read once at start-up: bfloat16 matmuls or not.

A CPU with AVX512-BF16 or AMX-BF16 multiplies bfloat16 in hardware (oneDNN's bf16 path); one
without emulates it, slower than float32. `torch.ops.mkldnn._is_mkldnn_bf16_supported` says
True for plain AVX512 too (emulated), so the kernel's own feature flags decide.
"""

from __future__ import annotations

import functools
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first processor's feature flags from /proc/cpuinfo; empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    return any(flag in (cpu_flags() if flags is None else flags) for flag in NATIVE_BF16_FLAGS)
