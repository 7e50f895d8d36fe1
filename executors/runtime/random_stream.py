"""Counter-based randomness: one uniform number per (request seed, token position, stream).

A token therefore never depends on which other requests share its batch, and replay is exact.
"""

from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1

SAMPLE = 0  # the token sampled at a position
ACCEPT = 1  # speculative acceptance test at a position
DRAFT = 2  # a draft model's own sample at a position
SIBLING = 16  # a draft tree: the acceptance test of a node's i-th child (i >= 1) is SIBLING + i


def _mix(x: int) -> int:
    # splitmix64 finaliser
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int, stream: int = SAMPLE) -> float:
    """A float in [0, 1) fixed by its three keys."""
    x = _mix(_mix(_mix(seed & MASK64) ^ position) ^ (stream * 0xD1B54A32D192ED03 & MASK64))
    return (x >> 11) * (1.0 / (1 << 53))


def uniforms(seeds: list[int], positions: list[int], stream: int = SAMPLE) -> np.ndarray:
    """`uniform` of each (seed, position) pair, float64, to the bit: the same splitmix64 in
    numpy's wrapping uint64 arithmetic (a batch of a thousand rows drew 3,000 Python mixes)."""
    x = _mix_array(np.array([seed & MASK64 for seed in seeds], dtype=np.uint64))
    x = _mix_array(x ^ np.array(positions, dtype=np.uint64))
    x = _mix_array(x ^ np.uint64(stream * 0xD1B54A32D192ED03 & MASK64))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _mix_array(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
