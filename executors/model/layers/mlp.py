"""The gated MLP's activation and the mixture-of-experts block, in torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memstep.executors.model.layers.block import Experts


def gated(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> act(gate) * up, [T, I]: SwiGLU or GeGLU (tanh GELU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"unknown MLP activation {activation!r}")


def route(x: torch.Tensor, experts: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's chosen experts and their weights, [T, k] each: softmax over the router's
    logits in float32, the top k, renormalised where the family does.  The logits themselves are
    computed in float32: rounded to bfloat16 they tie often enough to send a token to another
    expert than a float32 run does (a 0.86 cosine row in a tiny Qwen3-MoE)."""
    probs = torch.softmax(F.linear(x.float(), experts.router), dim=-1)
    weights, chosen = probs.topk(experts.top_k, dim=-1)
    if experts.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), chosen


def mixture(x: torch.Tensor, experts: Experts, activation: str) -> torch.Tensor:
    """[T, hidden] -> [T, hidden]: each token through its top-k experts, weighted. Rows are
    gathered by expert, so an expert no token chose costs nothing."""
    weights, chosen = route(x, experts)
    out = torch.zeros_like(x)
    for e in chosen.unique().tolist():
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        hidden = gated(F.linear(x[rows], experts.gate_up[e]), activation)
        out.index_add_(0, rows, F.linear(hidden, experts.down[e]) * weights[rows, slot, None])
    return out
