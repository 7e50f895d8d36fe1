"""The reference backend: the decoder in plain torch, a step at a time.

Every other backend's arithmetic is checked against it. Its steps (`norm`, `rotate_and_write`,
`attend`, `act`) are methods, so that the CPU backend replaces the ones its C kernels do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from memstep.executors.model.attention import ForwardBatch, attention
from memstep.executors.model.kv_cache import KvCaches, write_kv
from memstep.executors.model.quant_linear import Linear, make_linear

if TYPE_CHECKING:
    from memstep.executors.model.llama import LlamaModel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # the same arithmetic as below, in one kernel
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves as Hugging Face does; x: [T, H, D]; cos: [T, 1, D] (the D/2 angles twice),
    sin: [T, 1, D] (their sines, the first half negated): x1*cos - x2*sin, x2*cos + x1*sin."""
    xf = x.float()
    half = x.shape[-1] // 2
    return (xf * cos + torch.cat([xf[..., half:], xf[..., :half]], dim=-1) * sin).to(x.dtype)


class TorchBackend:
    """Plain torch ops; `decode_kernel` attends decode rows where given (else torch's SDPA)."""

    logits_in_place = False

    def __init__(self, decode_kernel=None):
        self.decode_kernel = decode_kernel

    def use_decode_attention(self, kernel) -> None:
        self.decode_kernel = kernel

    def linear(self, weights: dict[str, torch.Tensor], name: str, wide: bool) -> Linear:
        return make_linear(weights, name)

    def decoder(
        self, model: LlamaModel, h: torch.Tensor, batch: ForwardBatch, kv_caches: KvCaches
    ) -> torch.Tensor:
        cfg, t = model.cfg, batch.num_tokens
        rotary = self.rotary(model, batch)
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=False):
            attn_norm, wqkv, wo, mlp_norm, w_gate_up, w_down = layer
            qkv = wqkv(self.norm(h, attn_norm, cfg.rms_eps))
            q = self.rotate_and_write(model, qkv, batch, rotary, k_cache, v_cache)
            o = self.attend(model, q, k_cache, v_cache, batch)
            h = h + model.reduce(wo(o.reshape(t, -1)))
            gate_up = w_gate_up(self.norm(h, mlp_norm, cfg.rms_eps))
            h = h + model.reduce(w_down(self.act(gate_up)))
        return self.norm(h, model.w["norm"], cfg.rms_eps)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def rotary(self, model: LlamaModel, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's rotary factors, [T, 1, D] each, made once a forward."""
        cos = model.rope_cos[batch.positions].unsqueeze(1)
        return cos, model.rope_sin[batch.positions].unsqueeze(1)

    def rotate_and_write(
        self,
        model: LlamaModel,
        qkv: torch.Tensor,
        batch: ForwardBatch,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Rotary on q and k of `qkv` ([T, (H + 2 KVH) * D]), K and V written at the batch's
        slots; returns q, [T, H, D]."""
        cfg, t, d = model.cfg, batch.num_tokens, model.cfg.head_dim
        nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
        assert rotary is not None
        qk = qkv[:, : nq + nkv].reshape(t, cfg.num_heads + cfg.num_kv_heads, d)
        q, k = apply_rope(qk, *rotary).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = qkv[:, nq + nkv :].reshape(t, cfg.num_kv_heads, d)
        write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        return q

    def attend(
        self,
        model: LlamaModel,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        return attention(q, k_cache, v_cache, batch, model.scale, self.decode_kernel)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def head(
        self, model: LlamaModel, hidden: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        return model.head(hidden).float()
