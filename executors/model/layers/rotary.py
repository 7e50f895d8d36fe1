"""Rotary embedding tables: the plain frequencies, Llama 3's, linear and LongRoPE scaling, a
windowed layer's own base (Gemma 3), and partial rotary (the first `rope_dim` of a head)."""

from __future__ import annotations

import math
from typing import Any

import torch

from memstep.core.model_config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The global layers' inverse frequencies, [rope_dim / 2] float32."""
    return _inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling or {})


def _inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "longrope":  # transformers computes these in float32
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        return 1.0 / (short * theta**shape)
    return inv.float()


def longrope_tables(cfg: ModelConfig, positions: torch.Tensor) -> torch.Tensor:
    """LongRoPE's angles [P, rope_dim / 2]: the short factors below the original context, the
    long factors from it on (per position: a cached key keeps its rotation as the sequence
    grows, where transformers re-rotates the whole sequence once it passes the original
    length)."""
    scaling = cfg.rope_scaling or {}
    dim, theta = cfg.rope_dim, cfg.rope_theta
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    angles = []
    for key in ("short_factor", "long_factor"):
        inv = 1.0 / (torch.tensor(scaling[key], dtype=torch.float32) * theta**shape)
        angles.append(torch.outer(positions, inv))
    is_long = (positions >= scaling["original_max_position_embeddings"])[:, None]
    return torch.where(is_long, angles[1], angles[0])


def attention_factor(cfg: ModelConfig) -> float:
    """LongRoPE's scale of cos and sin (1 elsewhere)."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def angles(cfg: ModelConfig, max_positions: int, local: bool = False) -> torch.Tensor:
    """Each position's rotary angles, [P, rope_dim / 2] float32: the global layers', or with
    `local` the windowed layers' (their own base, no scaling)."""
    pos = torch.arange(max_positions, dtype=torch.float32)
    if local:
        assert cfg.local_rope_theta is not None
        return torch.outer(pos, _inv_freq(cfg.rope_dim, cfg.local_rope_theta, {}).float())
    if (cfg.rope_scaling or {}).get("rope_type") == "longrope":
        return longrope_tables(cfg, pos)
    return torch.outer(pos, rope_inv_freq(cfg))


def halves(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, D/2] cos and sin -> [P, D] each as `apply_rope` takes them (the sines' first half
    negated)."""
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
