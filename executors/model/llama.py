"""A Llama-family decoder over flattened token batches and a paged KV cache.

RMSNorm, rotary embeddings (with Llama-3 frequency scaling), grouped-query attention, SwiGLU,
tied or separate output head.  A draft model is the same class running only the first N layers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from memstep.core.model_config import ModelConfig
from memstep.executors.cpu import kernels as cpu_kernels
from memstep.executors.cpu.decode_step import DecodeStep
from memstep.executors.model.attention import ForwardBatch, attention
from memstep.executors.model.kv_cache import write_kv
from memstep.executors.model.quant_linear import Linear, make_linear
from memstep.executors.model.rank_group import RankGroup
from memstep.executors.model.weights import Weights


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


@functools.cache
def _kernels():
    """The Triton kernels package, imported on first use: never on a CPU-only path."""
    from memstep.executors.cuda import kernels

    return kernels


class LlamaModel:
    """Owns references to the weights (never copies them) and the rotary table.

    Under tensor parallelism (`ranks`) `cfg` is this rank's share (`rank_model_config`) and the
    weights are its shards (`sharding.py`): the attention output and the MLP's down projection
    are partial sums, all-reduced; the embedding and the head cover a slice of the vocabulary.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        max_positions: int,
        decode_kernel=None,
        ranks: RankGroup | None = None,
        bf16_products: bool = False,
    ):
        """`bf16_products`: the decoder's Q4_1 / Q8_0 matmuls multiply x's rows and the weights
        rounded to bfloat16, summing in float32 (matmul_precision "bfloat16"); the head and
        everything else stay float32."""
        self.cfg = cfg
        self.bf16_products = bf16_products
        self.ranks = ranks
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
        # float32 on the CPU: rotary and the KV write by cpu_kernels (with a float32 cache)
        fp32_cpu = device.type == "cpu" and self.lm_head.dtype == torch.float32
        self.cpu_kernels = fp32_cpu and ranks is None and cpu_kernels.available()
        # a model of Q4_1 / Q8_0 layer matrices: decode steps in one C call, and its norms and
        # silu * up in C for every batch, so that a row's bits do not depend on the step's kind
        self.decode_step = DecodeStep.of(cfg, weights, bf16_products) if self.cpu_kernels else None
        self.norm = cpu_kernels.rms_norm if self.decode_step is not None else rms_norm
        self.layers = [self._layer(i) for i in range(self.num_layers)]
        self.head = make_linear({"lm_head": self.lm_head, **weights}, "lm_head", self.wide)

    def _layer(self, i: int) -> tuple[torch.Tensor, Linear, Linear, torch.Tensor, Linear, Linear]:
        """Layer i's norms and matmuls, looked up once: (attn_norm, qkv, wo, mlp_norm,
        gate_up, down), each matmul a `Linear` over its float or quantized weight."""
        p = f"layers.{i}."
        wide = {"wqkv": self.wide, "wo": F.linear, "w_gate_up": self.wide, "w_down": F.linear}
        bf16 = self.bf16_products
        mm = {key: make_linear(self.w, p + key, dense, bf16) for key, dense in wide.items()}
        norms = self.w[p + "attn_norm"], self.w[p + "mlp_norm"]
        return norms[0], mm["wqkv"], mm["wo"], norms[1], mm["w_gate_up"], mm["w_down"]

    def use_decode_attention(self, kernel: Callable) -> None:
        """Attend decode rows with `kernel` from now on (the capture phase's, with its
        preallocated workspace)."""
        self.decode_kernel = kernel

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        """Hidden states after the final norm, [T, hidden]; writes this batch's K/V."""
        if self.w["embed"].device.type == "cuda":
            return self._forward_fused(batch, kv_caches)
        cfg = self.cfg
        h = self.embed(batch.input_ids)
        nq, nkv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        nqk = cfg.num_heads + cfg.num_kv_heads
        t = batch.num_tokens
        compiled = self.cpu_kernels and kv_caches[0][0].dtype == torch.float32
        step = self.decode_step if self.decode_kernel is cpu_kernels.decode_attention else None
        rows = step.rows(batch, kv_caches) if compiled and step is not None else None
        if step is not None and rows is not None:
            return step(h, batch, rows, kv_caches, self.cos, self.sin, self.scale)
        norm = self.norm
        if not compiled:
            cos = self.rope_cos[batch.positions].unsqueeze(1)
            sin = self.rope_sin[batch.positions].unsqueeze(1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=False):
            attn_norm, wqkv, wo, mlp_norm, w_gate_up, w_down = layer
            qkv = wqkv(norm(h, attn_norm, cfg.rms_eps))
            if compiled:  # the same arithmetic in one call
                q = cpu_kernels.rope_and_write_kv(
                    qkv, self.cos, self.sin, batch.positions, batch.slot_mapping,
                    k_cache, v_cache, cfg.num_heads,
                )  # fmt: skip
            else:
                qk = apply_rope(qkv[:, : nq + nkv].reshape(t, nqk, d), cos, sin)  # q, k at once
                q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
                v = qkv[:, nq + nkv :].reshape(t, cfg.num_kv_heads, d)
                write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
            o = attention(
                q, k_cache, v_cache, batch, self.scale, self.decode_kernel,
                queries_alone=self.decode_step is not None,
            )  # fmt: skip
            h = h + self.reduce(wo(o.reshape(t, nq)))
            gate_up = w_gate_up(norm(h, mlp_norm, cfg.rms_eps))
            if self.decode_step is not None:
                act = cpu_kernels.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            h = h + self.reduce(w_down(act))
        return norm(h, self.w["norm"], cfg.rms_eps)

    def _forward_fused(
        self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ):
        """`forward` on CUDA: `fused_layers` with this batch's attention (a prefill of
        thousands of tokens is otherwise a third elementwise traffic)."""

        def attend(q, k_cache, v_cache):
            return attention(q, k_cache, v_cache, batch, self.scale, self.decode_kernel)

        residual = self.embed(batch.input_ids)
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
        x = self.first_norm(residual)
        for i in range(self.num_layers):
            q = self.layer_in(i, x, positions, slots, kv_caches)
            x = self.layer_out(i, attend(q, *kv_caches[i]), residual)
        return x

    def first_norm(self, residual: torch.Tensor) -> torch.Tensor:
        """Layer 0's attention norm of the embeddings (Triton)."""
        return _kernels().rmsnorm(residual, self.w["layers.0.attn_norm"], self.cfg.rms_eps)

    def layer_in(
        self,
        i: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Layer i up to its attention (Triton + cuBLAS): qkv of `x` (its normed input), rotary,
        and the batch's K/V written to layer i's cache at `slots` (none where negative).
        Returns q, [T, H, D] (a view of the qkv rows)."""
        k_cache, v_cache = kv_caches[i]
        qkv = F.linear(x, self.w[f"layers.{i}.wqkv"])
        return _kernels().rope_and_write_kv(
            qkv, self.cos, self.sin, positions, slots, k_cache, v_cache, self.cfg.num_heads
        )

    def layer_out(self, i: int, o: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Layer i from its attention output `o` ([T, H, D]): wo and the MLP, each added to
        `residual` in place. Returns the next layer's normed input (after the last layer, the
        final norm's output)."""
        k, cfg, w, p = _kernels(), self.cfg, self.w, f"layers.{i}."
        attn = self.reduce(F.linear(o.reshape(o.shape[0], -1), w[p + "wo"]))
        x = k.fused_add_rmsnorm(attn, residual, w[p + "mlp_norm"], cfg.rms_eps)
        down = self.reduce(F.linear(k.silu_mul(F.linear(x, w[p + "w_gate_up"])), w[p + "w_down"]))
        last = i + 1 == self.num_layers
        next_norm = w["norm"] if last else w[f"layers.{i + 1}.attn_norm"]
        return k.fused_add_rmsnorm(down, residual, next_norm, cfg.rms_eps)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden]. Vocabulary-parallel: each rank looks up the ids of its
        slice (others give zero rows) and the ranks sum: one all-reduce of [T, hidden]."""
        table = self.w["embed"]
        if self.ranks is None:
            return F.embedding(ids, table)
        local = ids - self.ranks.rank * table.shape[0]
        mine = (local >= 0) & (local < table.shape[0])
        h = F.embedding(torch.where(mine, local, 0), table) * mine.unsqueeze(-1).to(table.dtype)
        return self.ranks.all_reduce(h)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel matmul's partial sums, summed over the ranks (in place)."""
        return partial if self.ranks is None else self.ranks.all_reduce(partial)

    @property
    def logits_in_place(self) -> bool:
        """Whether `logits` writes into the caller's buffer: on CUDA (cuBLAS has an out= form)
        on one rank; not on the CPU, where oneDNN's linear, faster for the head, has none, nor
        under tensor parallelism, where the all-gather makes the rows."""
        return self.lm_head.is_cuda and self.ranks is None

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in float32, into `out` ([N, vocab] float32) where
        `logits_in_place`. On CUDA in half precision the matmul writes float32 itself: no
        rounding of the logits to the weights' dtype, no second pass to widen them (at 256 rows
        of Llama-3.1-8B on an H200: 0.40 ms instead of 0.48).

        Vocabulary-parallel, every rank gets every rank's columns (all-gather) and samples the
        whole rows itself, the same tokens on each (sampling is keyed by seed and position):
        top-p, top-k, min-p, penalties and logprobs need whole rows, gathering them on rank 0
        alone moves the same bytes into rank 0, and the ranks then need no second collective
        to learn the sampled tokens."""
        if hidden.is_cuda and out is not None and self.logits_in_place:
            if hidden.dtype == torch.float32:
                return torch.mm(hidden, self.lm_head.t(), out=out)
            return torch.mm(hidden, self.lm_head.t(), out_dtype=torch.float32, out=out)
        if hidden.is_cuda and hidden.dtype != torch.float32:
            local = torch.mm(hidden, self.lm_head.t(), out_dtype=torch.float32)
        else:
            local = self.head(hidden).float()
        if self.ranks is None:
            return local
        whole = self.ranks.all_gather_columns(local)  # [N, padded vocab]
        vocab = self.cfg.vocab_size
        return whole if whole.shape[1] == vocab else whole[:, :vocab].contiguous()
