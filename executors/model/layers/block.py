"""One decoder layer's parts, looked up once where the model is built.

Every family's layer is this record: pre-norm attention (optional QKV bias, per-head q/k norm,
a sliding window, the global or the local rotary table) and a pre-norm MLP (dense gated, or
routed experts), with Gemma 3's norms after each where it has them. A part a family lacks is
None; the backend's decoder skips it.
"""

from __future__ import annotations

import attrs
import torch

from memstep.core.model_config import ModelConfig
from memstep.executors.model.quant_linear import Linear


@attrs.frozen
class DenseMlp:
    w_gate_up: Linear  # [T, hidden] -> [T, 2 * intermediate]: gate rows, then up rows
    w_down: Linear


@attrs.frozen
class Experts:
    router: torch.Tensor  # [E, hidden], float32 whatever the model's dtype (`route`)
    gate_up: torch.Tensor  # [E, 2 * expert width, hidden]
    down: torch.Tensor  # [E, hidden, expert width]
    top_k: int
    normalize: bool  # the chosen experts' weights renormalised to sum to 1


@attrs.frozen
class Block:
    attn_norm: torch.Tensor
    wqkv: Linear
    wo: Linear
    mlp_norm: torch.Tensor
    mlp: DenseMlp | Experts
    bqkv: torch.Tensor | None = None  # [(H + 2 KVH) * D]
    q_norm: torch.Tensor | None = None  # [D], every query head
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    window: int = 0  # sliding window in tokens; 0: the whole context
    rope: int = 0  # which rotary table: 0 global, 1 the windowed layers' own


def build_block(cfg: ModelConfig, w: dict[str, torch.Tensor], i: int, linear) -> Block:
    """Layer i of a model of config `cfg` over weights `w`; `linear(name, wide)` is the
    backend's matmul for one matrix."""
    p = f"layers.{i}."
    mlp: DenseMlp | Experts
    if cfg.is_moe:
        mlp = Experts(
            w[p + "router"].float(),  # once here, not a copy a step
            w[p + "experts_gate_up"],
            w[p + "experts_down"],
            cfg.experts_per_token,
            cfg.norm_topk_prob,
        )
    else:
        mlp = DenseMlp(linear(p + "w_gate_up", True), linear(p + "w_down", False))
    window = cfg.window(i)
    return Block(
        attn_norm=w[p + "attn_norm"],
        wqkv=linear(p + "wqkv", True),
        wo=linear(p + "wo", False),
        mlp_norm=w[p + "mlp_norm"],
        mlp=mlp,
        bqkv=w.get(p + "bqkv"),
        q_norm=w.get(p + "q_norm"),
        k_norm=w.get(p + "k_norm"),
        post_attn_norm=w.get(p + "post_attn_norm"),
        post_mlp_norm=w.get(p + "post_mlp_norm"),
        window=window,
        rope=1 if window and cfg.local_rope_theta is not None else 0,
    )
