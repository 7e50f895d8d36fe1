"""A Llama-family decoder over flattened token batches and a paged KV cache.

RMSNorm, rotary embeddings (with Llama-3 frequency scaling), grouped-query attention, SwiGLU,
tied or separate output head.  A draft model is the same class running only the first N layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from memstep.core.model_config import ModelConfig
from memstep.executors.attention import ForwardBatch, attention
from memstep.executors.kv_cache import write_kv
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


def wide_linear(device: torch.device, dtype: torch.dtype) -> Callable:
    """The matmul for weights with more outputs than inputs (qkv, gate_up, the head).

    On CPU in float32, oneDNN reads those 1.3-1.8x faster than MKL's gemm from 1 to 64 rows
    (2 AVX2 cores, SmolLM2 shapes); MKL stays faster for the narrow ones (wo, down).
    """
    onednn = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    on_cpu_fp32 = device.type == "cpu" and dtype == torch.float32
    if onednn is None or not (on_cpu_fp32 and torch.backends.mkldnn.is_available()):
        return F.linear
    return lambda x, w: onednn(x, w, None, "none", [], "")


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
        self.cos, self.sin = freqs.cos(), freqs.sin()  # [P, D/2], as the CUDA kernels take them
        self.rope_cos = torch.cat([self.cos, self.cos], dim=-1)  # [P, D], as apply_rope takes them
        self.rope_sin = torch.cat([-self.sin, self.sin], dim=-1)
        self.lm_head = weights.get("lm_head", weights["embed"])
        self.wide = wide_linear(device, self.lm_head.dtype)

    def use_decode_attention(self, kernel: Callable) -> None:
        """Attend decode rows with `kernel` from now on (the capture phase's, with its
        preallocated workspace)."""
        self.decode_kernel = kernel

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        """Hidden states after the final norm, [T, hidden]; writes this batch's K/V."""
        if self.w["embed"].device.type == "cuda":
            return self._forward_fused(batch, kv_caches)
        cfg = self.cfg
        h = F.embedding(batch.input_ids, self.w["embed"])
        cos = self.rope_cos[batch.positions].unsqueeze(1)
        sin = self.rope_sin[batch.positions].unsqueeze(1)
        nq, nkv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        nqk = cfg.num_heads + cfg.num_kv_heads
        t = batch.num_tokens
        for i in range(self.num_layers):
            p = f"layers.{i}."
            x = rms_norm(h, self.w[p + "attn_norm"], cfg.rms_eps)
            qkv = self.wide(x, self.w[p + "wqkv"])
            qk = apply_rope(qkv[:, : nq + nkv].reshape(t, nqk, d), cos, sin)  # q and k at once
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, nq + nkv :]
            k_cache, v_cache = kv_caches[i]
            write_kv(k_cache, v_cache, k, v.reshape(t, cfg.num_kv_heads, d), batch.slot_mapping)
            o = attention(q, k_cache, v_cache, batch, self.scale, self.decode_kernel)
            h = h + F.linear(o.reshape(t, nq), self.w[p + "wo"])
            x = rms_norm(h, self.w[p + "mlp_norm"], cfg.rms_eps)
            gate, up = self.wide(x, self.w[p + "w_gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, self.w[p + "w_down"])
        return rms_norm(h, self.w["norm"], cfg.rms_eps)

    def _forward_fused(
        self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ):
        """`forward` on CUDA: `fused_layers` with this batch's attention (a prefill of
        thousands of tokens is otherwise a third elementwise traffic)."""

        def attend(q, k_cache, v_cache):
            return attention(q, k_cache, v_cache, batch, self.scale, self.decode_kernel)

        residual = F.embedding(batch.input_ids, self.w["embed"])
        return self.fused_layers(residual, batch.positions, batch.slot_mapping, kv_caches, attend)

    def fused_layers(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The decoder layers with the CUDA path's Triton kernels (RMSNorm fused with the
        residual add, rotary + KV write, silu * up) around cuBLAS matmuls, for the eager path
        and the decode graphs alike. `residual` ([T, hidden], the embeddings) is updated in
        place; `attend(q, k_cache, v_cache)` is the caller's attention, [T, H, D] -> [T, H, D].
        Returns the final norm's output."""
        from memstep.executors.kernels import (
            fused_add_rmsnorm,
            rmsnorm,
            rope_and_write_kv,
            silu_mul,
        )

        cfg, w, t = self.cfg, self.w, residual.shape[0]
        x = rmsnorm(residual, w["layers.0.attn_norm"], cfg.rms_eps)
        for i, (k_cache, v_cache) in enumerate(kv_caches[: self.num_layers]):
            p = f"layers.{i}."
            qkv = F.linear(x, w[p + "wqkv"])
            q = rope_and_write_kv(
                qkv, self.cos, self.sin, positions, slots, k_cache, v_cache, cfg.num_heads
            )
            o = attend(q, k_cache, v_cache)
            x = fused_add_rmsnorm(
                F.linear(o.reshape(t, -1), w[p + "wo"]), residual, w[p + "mlp_norm"], cfg.rms_eps
            )
            down = F.linear(silu_mul(F.linear(x, w[p + "w_gate_up"])), w[p + "w_down"])
            last = i + 1 == self.num_layers
            next_norm = w["norm"] if last else w[f"layers.{i + 1}.attn_norm"]
            x = fused_add_rmsnorm(down, residual, next_norm, cfg.rms_eps)
        return x

    @property
    def logits_in_place(self) -> bool:
        """Whether `logits` writes into the caller's buffer: on CUDA (cuBLAS has an out= form);
        not on the CPU, where oneDNN's linear, faster for the head, has none."""
        return self.lm_head.is_cuda

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in float32, into `out` ([N, vocab] float32) where
        `logits_in_place`. On CUDA in half precision the matmul writes float32 itself: no
        rounding of the logits to the weights' dtype, no second pass to widen them (at 256 rows
        of Llama-3.1-8B on an H200: 0.40 ms instead of 0.48)."""
        if hidden.is_cuda and out is not None:
            if hidden.dtype == torch.float32:
                return torch.mm(hidden, self.lm_head.t(), out=out)
            return torch.mm(hidden, self.lm_head.t(), out_dtype=torch.float32, out=out)
        if hidden.is_cuda and hidden.dtype != torch.float32:
            return torch.mm(hidden, self.lm_head.t(), out_dtype=torch.float32)
        return self.wide(hidden, self.lm_head).float()
