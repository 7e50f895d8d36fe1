"""The CUDA backend: the decoder's layers as Triton kernels (RMSNorm fused with the residual add,
rotary + KV write, silu * up) around cuBLAS matmuls, for the eager path, the piecewise graphs
and the decode graphs alike (`decode.py`, `piecewise.py` call its layer halves).

Those kernels are Llama's layers. A family with other pieces (`ModelConfig.unlike_llama`: QKV
bias, q/k norms, windows, experts, ...) runs the torch reference layers eagerly, cuBLAS for the
matmuls and the paged decode kernel for its global layers' decode rows (windowed layers attend
in torch), without CUDA graphs: logged once at load by `log_torch_pieces`."""

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
from memstep.executors.model.torch_backend import TorchBackend

if TYPE_CHECKING:
    from memstep.executors.model.llama import LlamaModel

log = structlog.get_logger("memstep.executor.cuda")

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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
        scale, kernel = model.scale, self.decode_kernel
        return attention(
            q, k_cache, v_cache, batch, scale, kernel, out, window=window, device_kernels=True
        )

    def decoder(
        self, model: LlamaModel, h: torch.Tensor, batch: ForwardBatch, kv_caches: KvCaches
    ) -> torch.Tensor:
        """`fused_layers` with this batch's attention (a prefill of thousands of tokens is
        otherwise a third more elementwise traffic); a family whose layers differ from Llama's
        runs the torch layers (`TorchBackend.decoder`), said at load (`cuda_backend_for`)."""
        if model.cfg.unlike_llama:
            return super().decoder(model, h, batch, kv_caches)

        def attend(q, k_cache, v_cache):
            return self.attend(model, q, k_cache, v_cache, batch)

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
        `attend(q, k_cache, v_cache)` is the caller's attention, [T, H, D] -> [T, H, D].
        Returns the final norm's output."""
        x = self.first_norm(model, residual)
        for i in range(model.num_layers):
            q = self.layer_in(model, i, x, positions, slots, kv_caches)
            x = self.layer_out(model, i, attend(q, *kv_caches[i]), residual)
        return x

    def first_norm(self, model: LlamaModel, residual: torch.Tensor) -> torch.Tensor:
        """Layer 0's attention norm of the embeddings."""
        return kernels.rmsnorm(residual, model.w["layers.0.attn_norm"], model.cfg.rms_eps)

    def layer_in(
        self,
        model: LlamaModel,
        i: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv_caches: KvCaches,
    ) -> torch.Tensor:
        """Layer i up to its attention: qkv of `x` (its normed input), rotary, and the batch's
        K/V written to layer i's cache at `slots` (none where negative). Returns q, [T, H, D]
        (a view of the qkv rows)."""
        k_cache, v_cache = kv_caches[i]
        qkv = F.linear(x, model.w[f"layers.{i}.wqkv"])
        return kernels.rope_and_write_kv(
            qkv, model.cos, model.sin, positions, slots, k_cache, v_cache, model.cfg.num_heads
        )

    def layer_out(
        self, model: LlamaModel, i: int, o: torch.Tensor, residual: torch.Tensor
    ) -> torch.Tensor:
        """Layer i from its attention output `o` ([T, H, D]): wo and the MLP, each added to
        `residual` in place. Returns the next layer's normed input (after the last layer, the
        final norm's output)."""
        cfg, w, p = model.cfg, model.w, f"layers.{i}."
        attn = model.reduce(F.linear(o.reshape(o.shape[0], -1), w[p + "wo"]))
        x = kernels.fused_add_rmsnorm(attn, residual, w[p + "mlp_norm"], cfg.rms_eps)
        gate_up = F.linear(x, w[p + "w_gate_up"])
        down = model.reduce(F.linear(kernels.silu_mul(gate_up), w[p + "w_down"]))
        last = i + 1 == model.num_layers
        next_norm = w["norm"] if last else w[f"layers.{i + 1}.attn_norm"]
        return kernels.fused_add_rmsnorm(down, residual, next_norm, cfg.rms_eps)

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


def log_torch_pieces(cfg: ModelConfig) -> bool:
    """Whether the model needs the torch layers on CUDA (then no CUDA graphs), said once."""
    lacks = cfg.unlike_llama
    if lacks:
        log.warning(
            f"backend cuda lacks {', '.join(lacks)} for family {cfg.architecture}; torch runs "
            "its layers eagerly (CUDA graphs off; windowed layers attend in torch)",
            family=cfg.architecture,
        )
    return bool(lacks)


def cuda_backend(model: LlamaModel) -> CudaBackend:
    """The model's backend, which the decode and piecewise graphs call layer by layer."""
    backend = model.backend
    if not isinstance(backend, CudaBackend):
        raise TypeError(f"CUDA graphs need the CUDA backend, not {type(backend).__name__}")
    return backend
