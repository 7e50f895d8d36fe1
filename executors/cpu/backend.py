"""The CPU backend: the torch reference with the steps that memstep's C kernels do replaced.

What it replaces is decided once, when it is made (`CpuBackend.choose`):
* with a float32 model on one rank and a float32 KV cache: rotary + KV write in C;
* with a C decode-attention kernel (a float32 cache): decode rows, and short queries, attended
  in C reading the pages in place;
* for a family whose layers differ from Llama's (`ModelConfig.unlike_llama`) by more than a
  QKV bias and q/k norms (C_PIECES: Qwen2's and Qwen3's, which C runs), none of the above but
  decode attention of its global layers: torch runs its layers, logged once, their matrices
  through `linear` (the block kernels where a GGUF's blocks were kept);
* for a model whose every layer matrix is blocks (`DecodeStep.of`): the
  norms and silu * up in C for every batch, every query attended as a decode row of its own,
  and batches of decode rows run as one C call (`DecodeStep`), so that a row's bits do not
  depend on the step's kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
import torch

from memstep.core.model_config import ModelConfig
from memstep.executors.cpu import kernels as cpu_kernels
from memstep.executors.cpu.decode_step import DecodeStep
from memstep.executors.cpu.linear import cpu_linear, wide_dense
from memstep.executors.model.attention import ForwardBatch, attention
from memstep.executors.model.kv_cache import KvCaches
from memstep.executors.model.quant_linear import Linear
from memstep.executors.model.torch_backend import TorchBackend

log = structlog.get_logger("memstep.executor.cpu")

if TYPE_CHECKING:
    from memstep.executors.model.llama import LlamaModel


class CpuBackend(TorchBackend):
    def __init__(
        self,
        decode_kernel=None,
        c_rotary: bool = False,
        step: DecodeStep | None = None,
        dtype: torch.dtype = torch.float32,
        bf16_products: bool = False,
    ):
        super().__init__(decode_kernel)
        self.c_rotary = c_rotary
        self.step = step  # the layers in C: norms and silu * up for every batch
        # the whole step in one call, for batches of decode rows (needs C decode attention)
        self.one_call = step if c_rotary and decode_kernel is not None else None
        self.wide = wide_dense(dtype)
        self.bf16_products = bf16_products

    @classmethod
    def choose(
        cls,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        kv_dtype: torch.dtype,
        one_rank: bool,
        bf16_products: bool = False,
        decode_attention: bool = True,
    ) -> CpuBackend:
        """The C kernels wherever they apply to this model, cache and rank count (see the
        module's docstring); `decode_attention=False` keeps torch's attention (a draft model)."""
        dtype = weights.get("lm_head", weights["embed"]).dtype
        built = cpu_kernels.available()
        attends = built and kv_dtype == torch.float32 and cpu_kernels.attends(cfg.head_dim)
        kernel = cpu_kernels.decode_attention if attends and decode_attention else None
        compiled = built and one_rank and dtype == torch.float32 and not _torch_pieces(cfg)
        step = DecodeStep.of(cfg, weights, bf16_products) if compiled else None
        c_rotary = compiled and kv_dtype == torch.float32
        return cls(kernel, c_rotary, step, dtype, bf16_products)

    def linear(self, weights: dict[str, torch.Tensor], name: str, wide: bool) -> Linear:
        dense = self.wide if wide else torch.nn.functional.linear
        return cpu_linear(weights, name, dense, self.bf16_products and name != "lm_head")

    def decoder(
        self, model: LlamaModel, h: torch.Tensor, batch: ForwardBatch, kv_caches: KvCaches
    ) -> torch.Tensor:
        if self.one_call is not None:
            rows = self.one_call.rows(batch, kv_caches)
            if rows is not None:
                return self.one_call(h, batch, rows, kv_caches, model.cos, model.sin, model.scale)
        return super().decoder(model, h, batch, kv_caches)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.step is not None:
            return cpu_kernels.rms_norm(x, weight, eps)
        return super().norm(x, weight, eps)

    def rotary(self, model: LlamaModel, batch: ForwardBatch):
        return None if self.c_rotary else super().rotary(model, batch)

    def rotate_and_write(
        self, model, qkv, batch, rotary, k_cache, v_cache, block=None
    ) -> torch.Tensor:
        if not self.c_rotary:
            return super().rotate_and_write(model, qkv, batch, rotary, k_cache, v_cache, block)
        if block is not None and block.q_norm is not None and block.k_norm is not None:
            self._qk_norms(model, qkv, block.q_norm, block.k_norm)
        return cpu_kernels.rope_and_write_kv(
            qkv,
            model.cos,
            model.sin,
            batch.positions,
            batch.slot_mapping,
            k_cache,
            v_cache,
            model.cfg.num_heads,
        )

    def _qk_norms(self, model, qkv: torch.Tensor, q_norm, k_norm) -> None:
        """Each q and k head of `qkv` RMS-normed in place by the C norm, as the one-call step
        norms them (Qwen3's)."""
        cfg, t = model.cfg, qkv.shape[0]
        nq, nk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for lo, hi, weight in ((0, nq, q_norm), (nq, nq + nk, k_norm)):
            heads = qkv[:, lo:hi].reshape(-1, cfg.head_dim)
            qkv[:, lo:hi] = cpu_kernels.rms_norm(heads, weight, cfg.rms_eps).view(t, hi - lo)

    def attend(self, model, q, k_cache, v_cache, batch, window: int = 0) -> torch.Tensor:
        queries_alone = self.step is not None
        return attention(
            q,
            k_cache,
            v_cache,
            batch,
            model.scale,
            self.decode_kernel,
            queries_alone=queries_alone,
            window=window,
        )

    def act(self, gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        if self.step is not None and activation == "silu":
            return cpu_kernels.silu_mul(gate_up)
        return super().act(gate_up, activation)


# of a family's pieces (`ModelConfig.unlike_llama`), those the C kernels run too
C_PIECES = ("QKV bias", "q/k norm")


def _torch_pieces(cfg: ModelConfig) -> bool:
    """Whether the model has layer pieces the C kernels lack (they run Llama's layers and
    C_PIECES): then torch runs its layers, said once at load, never silently."""
    lacks = [piece for piece in cfg.unlike_llama if piece not in C_PIECES]
    if lacks:
        log.warning(
            f"backend cpu lacks {', '.join(lacks)} for family {cfg.architecture}; torch runs its "
            "layers (C decode attention kept for global layers)",
            family=cfg.architecture,
        )
    return bool(lacks)
