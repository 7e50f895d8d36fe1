"""The reference backend: the decoder in plain torch, a step at a time.

Every other backend's arithmetic is checked against it, and it runs every family's layers
(`layers/block.py`). Its steps (`norm`, `rotate_and_write`, `attend`, `act`, `mlp`) are methods,
so that the CPU backend replaces the ones its C kernels do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from memstep.executors.model.attention import ForwardBatch, attention
from memstep.executors.model.kv_cache import KvCaches, write_kv
from memstep.executors.model.layers.block import Block, Experts
from memstep.executors.model.layers.mlp import gated, mixture
from memstep.executors.model.quant_linear import Linear, make_linear

if TYPE_CHECKING:
    from memstep.executors.model.llama import LlamaModel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # the same arithmetic as below, in one kernel
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int | None = None
) -> torch.Tensor:
    """Rotate halves as Hugging Face does; x: [T, H, D]; cos: [T, 1, R] (the R/2 angles twice),
    sin: [T, 1, R] (their sines, the first half negated): x1*cos - x2*sin, x2*cos + x1*sin, on
    the first `dim` (R) of each head; the rest passes through (partial rotary)."""
    if dim is not None and dim < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)
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
        cfg, t, eps = model.cfg, batch.num_tokens, model.cfg.rms_eps
        rotary = self.rotary(model, batch)
        for block, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=False):
            qkv = block.wqkv(self.norm(h, block.attn_norm, eps))
            if block.bqkv is not None:
                qkv = qkv + block.bqkv
            table = None if rotary is None else rotary[block.rope]
            q = self.rotate_and_write(model, qkv, batch, table, k_cache, v_cache, block)
            o = self.attend(model, q, k_cache, v_cache, batch, window=block.window)
            attn = model.reduce(block.wo(o.reshape(t, -1)))
            h = h + self.post_norm(attn, block.post_attn_norm, eps)
            mlp = self.mlp(model, block, self.norm(h, block.mlp_norm, eps))
            h = h + self.post_norm(mlp, block.post_mlp_norm, eps)
        return self.norm(h, model.w["norm"], cfg.rms_eps)

    def post_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """Gemma's norm of a sublayer's output before the residual add (none elsewhere)."""
        return x if weight is None else self.norm(x, weight, eps)

    def mlp(self, model: LlamaModel, block: Block, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP of its normed input, summed over the ranks."""
        if isinstance(block.mlp, Experts):
            return mixture(x, block.mlp, model.cfg.activation)
        gate_up = block.mlp.w_gate_up(x)
        return model.reduce(block.mlp.w_down(self.act(gate_up, model.cfg.activation)))

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def rotary(
        self, model: LlamaModel, batch: ForwardBatch
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The batch's rotary factors of each of the model's tables, [T, 1, D] each, made once a
        forward."""
        return [
            (cos[batch.positions].unsqueeze(1), sin[batch.positions].unsqueeze(1))
            for cos, sin in model.rope_tables
        ]

    def rotate_and_write(
        self,
        model: LlamaModel,
        qkv: torch.Tensor,
        batch: ForwardBatch,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block: Block | None = None,
    ) -> torch.Tensor:
        """Rotary on q and k of `qkv` ([T, (H + 2 KVH) * D]; after the block's q/k norms where
        it has them), K and V written at the batch's slots; returns q, [T, H, D]."""
        cfg, t, d = model.cfg, batch.num_tokens, model.cfg.head_dim
        nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
        assert rotary is not None
        v = qkv[:, nq + nkv :].reshape(t, cfg.num_kv_heads, d)
        qk = qkv[:, : nq + nkv].reshape(t, cfg.num_heads + cfg.num_kv_heads, d)
        if block is None or block.q_norm is None:
            qk = apply_rope(qk, *rotary, cfg.rope_dim)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        else:
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            assert block.k_norm is not None
            q = apply_rope(self.norm(q, block.q_norm, cfg.rms_eps), *rotary, cfg.rope_dim)
            k = apply_rope(self.norm(k, block.k_norm, cfg.rms_eps), *rotary, cfg.rope_dim)
        write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        return q

    def attend(
        self,
        model: LlamaModel,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        window: int = 0,
    ) -> torch.Tensor:
        return attention(q, k_cache, v_cache, batch, model.scale, self.decode_kernel, window=window)

    def act(self, gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        return gated(gate_up, activation)

    def head(
        self, model: LlamaModel, hidden: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        return model.head(hidden).float()
