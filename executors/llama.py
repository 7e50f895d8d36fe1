"""A Llama-family decoder over flattened token batches and a paged KV cache.

RMSNorm, rotary embeddings (with Llama-3 frequency scaling), grouped-query attention, SwiGLU,
tied or separate output head.  A draft model is the same class running only the first N layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from memstep.executors.attention import ForwardBatch, attention, write_kv
from memstep.executors.model_config import ModelConfig
from memstep.executors.weights import Weights


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = torch.where(is_mid, mid, scaled)
    return inv.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, 1, D/2]; rotate halves as Hugging Face does
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class LlamaModel:
    """Owns references to the weights (never copies them) and the rotary table."""

    def __init__(self, cfg: ModelConfig, weights: Weights, max_positions: int, decode_kernel=None):
        self.cfg = cfg
        self.w = weights
        self.num_layers = cfg.num_layers
        self.scale = cfg.head_dim**-0.5
        self.decode_kernel = decode_kernel
        device = weights["embed"].device
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(cfg)).to(device)
        self.cos, self.sin = freqs.cos(), freqs.sin()  # [P, D/2]
        self.lm_head = weights.get("lm_head", weights["embed"])

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        """Hidden states after the final norm, [T, hidden]; writes this batch's K/V."""
        cfg = self.cfg
        h = F.embedding(batch.input_ids, self.w["embed"])
        cos = self.cos[batch.positions].unsqueeze(1)
        sin = self.sin[batch.positions].unsqueeze(1)
        nq, nkv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        t = batch.num_tokens
        for i in range(self.num_layers):
            p = f"layers.{i}."
            x = rms_norm(h, self.w[p + "attn_norm"], cfg.rms_eps)
            qkv = F.linear(x, self.w[p + "wqkv"])
            q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
            q = apply_rope(q.view(t, cfg.num_heads, d), cos, sin)
            k = apply_rope(k.view(t, cfg.num_kv_heads, d), cos, sin)
            k_cache, v_cache = kv_caches[i]
            write_kv(k_cache, v_cache, k, v.reshape(t, cfg.num_kv_heads, d), batch.slot_mapping)
            o = attention(q, k_cache, v_cache, batch, self.scale, self.decode_kernel)
            h = h + F.linear(o.reshape(t, nq), self.w[p + "wo"])
            x = rms_norm(h, self.w[p + "mlp_norm"], cfg.rms_eps)
            gate, up = F.linear(x, self.w[p + "w_gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, self.w[p + "w_down"])
        return rms_norm(h, self.w["norm"], cfg.rms_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in float32."""
        return F.linear(hidden, self.lm_head).float()
