"""Host memory the executor would otherwise keep for ever: oneDNN's caches, and freed heap pages.

On the CPU the head, qkv and gate-up matmuls run through oneDNN (`executors/cpu/linear.py`), which
compiles one primitive per input shape and keeps it in two caches: oneDNN's own and ideep's
(PyTorch's wrapper), each 1,024 entries by default.  Serving meets a new shape for every new
number of tokens in a step, so each cache grew with the requests served, by about 0.6 MiB a
shape: 400 shapes of SmolLM2's gate-up added 250 MiB of resident memory (a 2-core machine,
torch 2.13), and a 64-client ShareGPT soak grew the executor by 160 MiB in 11 minutes, every
tensor figure flat.  Bounded to `ONEDNN_CACHE_CAPACITY` entries each, the same 400 shapes add
~38 MiB, of which glibc keeps most as freed but unreturned heap; `HostTrim` gives such pages
back (`malloc_trim`) whenever the resident set has grown by `slack` since it last did.
A new shape costs one compile (~10 ms for SmolLM2's gate-up on 2 cores) when it misses the
cache: a few per prefill step of new length.  A user's own settings of either cache win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from memstep.core.host_memory import MIB, rss_bytes

ONEDNN_CACHE_CAPACITY = 32
CACHE_ENV_NAMES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Bound both primitive caches; call before the first oneDNN matmul (each reads its
    capacity once, when first used)."""
    for name in CACHE_ENV_NAMES:
        os.environ.setdefault(name, str(capacity))


def _malloc_trim():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None)  # glibc only


class HostTrim:
    """Measures the process's resident bytes after a step; past `slack` bytes over the level
    after its last trim, first gives freed heap pages back to the OS and measures again.
    Memory still in use cannot be given back, so a real leak still grows."""

    def __init__(self, slack: int = 16 * MIB):
        self.slack = slack
        self.level = rss_bytes()
        self._trim = _malloc_trim()
        self.num_trims = 0

    def measure(self) -> int:
        rss = rss_bytes()
        if self._trim is not None and rss > self.level + self.slack:
            self._trim(0)
            self.num_trims += 1
            rss = rss_bytes()
            self.level = rss
        return rss
