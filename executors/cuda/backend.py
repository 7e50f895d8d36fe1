"""The CUDA backend: the decoder's layers as Triton kernels (RMSNorm fused with the residual add,
rotary + KV write, the gated activation, the experts' grouped GEMMs) around cuBLAS matmuls, for
the eager path, the piecewise graphs and the decode graphs alike (`decode.py`, `piecewise.py`
call its layer halves).

Every family runs here with its graphs on: what a family adds to Llama's layer is a branch of
the layer halves, read from its layer record (`layers/block.py`): the QKV bias in the qkv
matmul, per-head q/k norms (the RMSNorm kernel), Gemma's norms after each sublayer, a windowed
layer's own rotary table and its window in the decode kernel and flash attention, GeGLU, and
the fused mixture of experts (`kernels/fused_moe.py`). A few pieces are torch ops inside the
graphs (capturable, no Triton kernel of their own): they are named once at load by
`log_family_pieces`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog
import torch
import torch.nn.functional as F

from memstep.core.model_config import ModelConfig
from memstep.executors.cuda import kernels
from memstep.executors.model.attention import ForwardBatch, attention
from memstep.executors.model.kv_cache import KvCaches
from memstep.executors.model.layers.block import Block, Experts
from memstep.executors.model.torch_backend import TorchBackend, apply_rope

if TYPE_CHECKING:
    from memstep.executors.model.llama import LlamaModel

log = structlog.get_logger("memstep.executor.cuda")

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


class CudaBackend(TorchBackend):
    def __init__(self, decode_kernel=None, one_rank: bool = True):
        """`decode_kernel`: the paged decode kernel (None: torch's attention, a draft model);
        `one_rank`: cuBLAS writes the logits into the sampler's buffer (under tensor
        parallelism the all-gather makes the rows)."""
        super().__init__(decode_kernel)
        self.logits_in_place = one_rank

    def attend(
        self,
        model: LlamaModel,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        out: torch.Tensor | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        kernel = self.decode_kernel  # CUDA's takes a window: windowed decode rows stay in it
        return attention(
            q, k_cache, v_cache, batch, model.scale, kernel, out, window=window, device_kernels=True
        )

    def decoder(
        self, model: LlamaModel, h: torch.Tensor, batch: ForwardBatch, kv_caches: KvCaches
    ) -> torch.Tensor:
        """`fused_layers` with this batch's attention (a prefill of thousands of tokens is
        otherwise a third more elementwise traffic)."""

        def attend(q, k_cache, v_cache, window):
            return self.attend(model, q, k_cache, v_cache, batch, window=window)

        return self.fused_layers(model, h, batch.positions, batch.slot_mapping, kv_caches, attend)

    def fused_layers(
        self,
        model: LlamaModel,
        residual: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv_caches: KvCaches,
        attend: Attend,
    ) -> torch.Tensor:
        """The decoder layers. `residual` ([T, hidden], the embeddings) is updated in place;
        `attend(q, k_cache, v_cache, window)` is the caller's attention, [T, H, D] -> [T, H, D]
        (`window` > 0: the layer's sliding window). Returns the final norm's output."""
        x = self.first_norm(model, residual)
        for i, block in enumerate(model.layers):
            q = self.layer_in(model, i, x, positions, slots, kv_caches)
            k_cache, v_cache = kv_caches[i]
            x = self.layer_out(model, i, attend(q, k_cache, v_cache, block.window), residual)
        return x

    def first_norm(self, model: LlamaModel, residual: torch.Tensor) -> torch.Tensor:
        """Layer 0's attention norm of the embeddings."""
        return kernels.rmsnorm(residual, model.layers[0].attn_norm, model.cfg.rms_eps)

    def layer_in(
        self,
        model: LlamaModel,
        i: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv_caches: KvCaches,
    ) -> torch.Tensor:
        """Layer i up to its attention: qkv of `x` (its normed input; with its bias), the q/k
        norms where it has them, rotary, and the batch's K/V written to layer i's cache at
        `slots` (none where negative). Returns q, [T, H, D] (a view of the qkv rows)."""
        cfg, block = model.cfg, model.layers[i]
        k_cache, v_cache = kv_caches[i]
        qkv = F.linear(x, model.w[f"layers.{i}.wqkv"], block.bqkv)
        qk_norm = None
        if block.q_norm is not None and block.k_norm is not None:
            qk_norm = (block.q_norm, block.k_norm, cfg.rms_eps)  # in the rotary kernel
        cos, sin = rotary_tables(model, block)
        if cfg.rope_dim != cfg.head_dim:  # partial rotary: torch rotates, the kernel writes
            if qk_norm is not None:
                self.qk_norms(model, block, qkv)
                qk_norm = None
            self.partial_rotary(model, block, qkv, positions)
            cos, sin = unrotated(cos, cfg.head_dim)
        return kernels.rope_and_write_kv(
            qkv, cos, sin, positions, slots, k_cache, v_cache, cfg.num_heads, qk_norm
        )

    def qk_norms(self, model: LlamaModel, block: Block, qkv: torch.Tensor) -> None:
        """Each head of q and of k of `qkv` ([T, (H + 2 KVH) * D]) RMS-normed in place (the
        RMSNorm kernel), where torch rotates them after (partial rotary); else the rotary
        kernel norms them itself."""
        cfg, t, d = model.cfg, qkv.shape[0], model.cfg.head_dim
        nq, nk = cfg.num_heads * d, cfg.num_kv_heads * d
        assert block.q_norm is not None and block.k_norm is not None
        for heads, weight in ((qkv[:, :nq], block.q_norm), (qkv[:, nq : nq + nk], block.k_norm)):
            view = heads.view(t, -1, d)
            view.copy_(kernels.rmsnorm(view, weight, cfg.rms_eps))

    def partial_rotary(
        self, model: LlamaModel, block: Block, qkv: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Rotary on the first `rope_dim` of each q and k head of `qkv`, in place (torch)."""
        cfg, t, d = model.cfg, qkv.shape[0], model.cfg.head_dim
        qk = qkv[:, : (cfg.num_heads + cfg.num_kv_heads) * d].view(t, -1, d)
        cos, sin = model.rope_tables[block.rope]
        table = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        qk.copy_(apply_rope(qk, *table, cfg.rope_dim))

    def layer_out(
        self, model: LlamaModel, i: int, o: torch.Tensor, residual: torch.Tensor
    ) -> torch.Tensor:
        """Layer i from its attention output `o` ([T, H, D]): wo and the MLP, each added to
        `residual` in place (each normed first where the layer has Gemma's post norms).
        Returns the next layer's normed input (after the last layer, the final norm's
        output)."""
        cfg, block, eps = model.cfg, model.layers[i], model.cfg.rms_eps
        attn = model.reduce(F.linear(o.reshape(o.shape[0], -1), model.w[f"layers.{i}.wo"]))
        if block.post_attn_norm is not None:
            attn = kernels.rmsnorm(attn, block.post_attn_norm, eps)
        x = kernels.fused_add_rmsnorm(attn, residual, block.mlp_norm, eps)
        mlp = self.mlp(model, block, x)
        if block.post_mlp_norm is not None:
            mlp = kernels.rmsnorm(mlp, block.post_mlp_norm, eps)
        last = i + 1 == model.num_layers
        next_norm = model.w["norm"] if last else model.layers[i + 1].attn_norm
        return kernels.fused_add_rmsnorm(mlp, residual, next_norm, cfg.rms_eps)

    def mlp(self, model: LlamaModel, block: Block, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP of its normed input, summed over the ranks: the fused experts, or
        gate_up, the gated activation and down."""
        if isinstance(block.mlp, Experts):
            return kernels.fused_moe(x, block.mlp, model.cfg.activation)
        act = kernels.gated_product(block.mlp.w_gate_up(x), model.cfg.activation)
        return model.reduce(block.mlp.w_down(act))

    def head(
        self, model: LlamaModel, hidden: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        """In half precision the matmul writes float32 itself: no rounding of the logits to the
        weights' dtype, no second pass to widen them (docs/benchmarks.md, "Figures behind the
        code's constants")."""
        if out is not None and self.logits_in_place:
            if hidden.dtype == torch.float32:
                return torch.mm(hidden, model.lm_head.t(), out=out)
            return torch.mm(hidden, model.lm_head.t(), out_dtype=torch.float32, out=out)
        if hidden.dtype != torch.float32:
            return torch.mm(hidden, model.lm_head.t(), out_dtype=torch.float32)
        return model.head(hidden).float()


def rotary_tables(model: LlamaModel, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's cos and sin, [P, D / 2] as the rotary kernel takes them: the global tables,
    or a windowed layer's own (`Block.rope`; halves of `apply_rope`'s [P, D] tables)."""
    if block.rope == 0:
        return model.cos, model.sin
    cos, sin = model.rope_tables[block.rope]
    half = cos.shape[1] // 2
    return cos[:, :half], sin[:, half:]


def unrotated(cos: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables that rotate by nothing (cos 1, sin 0; one row, read at every position), for the
    kernel to write K and V that torch has rotated already."""
    ones = cos.new_ones(1, head_dim // 2)
    return ones.expand(cos.shape[0], -1), torch.zeros_like(ones).expand(cos.shape[0], -1)


def torch_pieces(cfg: ModelConfig) -> tuple[str, ...]:
    """What of this model's layers CUDA runs as torch ops inside its graphs (no Triton kernel of
    their own), beside cuBLAS's matmuls: empty for Llama's layers."""
    facts = {
        "partial rotary": cfg.rope_dim != cfg.head_dim,
        "experts' router top-k and sort by expert": cfg.is_moe,
    }
    return tuple(name for name, has in facts.items() if has)


def log_family_pieces(cfg: ModelConfig) -> None:
    """Say once, at load, what the family runs on CUDA: graphs on, and which pieces torch."""
    if not cfg.unlike_llama:
        return
    log.info(
        f"backend cuda runs family {cfg.architecture}'s {', '.join(cfg.unlike_llama)} in its "
        "fused layers, so CUDA graphs stay on; torch ops inside them: "
        f"{', '.join(torch_pieces(cfg)) or 'none'}",
        family=cfg.architecture,
        graphs=True,
        torch_pieces=list(torch_pieces(cfg)),
    )


def cuda_backend(model: LlamaModel) -> CudaBackend:
    """The model's backend, which the decode and piecewise graphs call layer by layer."""
    backend = model.backend
    if not isinstance(backend, CudaBackend):
        raise TypeError(f"CUDA graphs need the CUDA backend, not {type(backend).__name__}")
    return backend
