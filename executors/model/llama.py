"""A Llama-family decoder over flattened token batches and a paged KV cache.

RMSNorm, rotary embeddings (with Llama-3 frequency scaling), grouped-query attention, SwiGLU,
tied or separate output head.  A draft model is the same class running only the first N layers.
The model holds the weights, the rotary tables and the layer structure; its `Backend` does the
arithmetic: the torch reference (`torch_backend.py`), the CPU's C kernels (`executors/cpu/`) or
CUDA's Triton kernels and cuBLAS (`executors/cuda/`), chosen once where the model is built
(`executors/runtime/backends.py`). The model never asks which device it runs on.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

from memstep.core.model_config import ModelConfig
from memstep.executors.model.attention import ForwardBatch
from memstep.executors.model.kv_cache import KvCaches
from memstep.executors.model.quant_linear import Linear
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


class Backend(Protocol):
    """The operations the decoder needs. `decoder` runs every layer and the final norm;
    `linear` makes a matmul for one weight matrix (its quantized form if it has one); `head`
    gives the float32 logits of this rank's vocabulary slice."""

    @property
    def logits_in_place(self) -> bool:
        """Whether `head` writes into the caller's buffer (the sampler keeps one if so)."""
        ...

    def linear(self, weights: dict[str, torch.Tensor], name: str, wide: bool) -> Linear:
        """x [T, K] -> x @ W^T [T, N] for matrix `name`; `wide`: more outputs than inputs."""
        ...

    def decoder(
        self, model: LlamaModel, h: torch.Tensor, batch: ForwardBatch, kv_caches: KvCaches
    ) -> torch.Tensor:
        """The layers over the embeddings `h` ([T, hidden]); writes the batch's K/V and returns
        the final norm's output, [T, hidden]."""
        ...

    def head(
        self, model: LlamaModel, hidden: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        """[N, hidden] -> [N, this rank's vocabulary] float32 logits (into `out` where
        `logits_in_place`)."""
        ...

    def use_decode_attention(self, kernel) -> None:
        """Attend decode rows with `kernel` from now on (CUDA's capture phase gives one with its
        preallocated workspace)."""
        ...


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
        backend: Backend,
        ranks: RankGroup | None = None,
    ):
        self.cfg = cfg
        self.backend = backend
        self.ranks = ranks
        self.w = weights
        self.num_layers = cfg.num_layers
        self.scale = cfg.head_dim**-0.5
        device = weights["embed"].device
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(cfg)).to(device)
        self.cos, self.sin = freqs.cos(), freqs.sin()  # [P, D/2], as the fused kernels take them
        self.rope_cos = torch.cat([self.cos, self.cos], dim=-1)  # [P, D], as apply_rope takes them
        self.rope_sin = torch.cat([-self.sin, self.sin], dim=-1)
        self.lm_head = weights.get("lm_head", weights["embed"])
        self.layers = [self._layer(i) for i in range(self.num_layers)]
        self.head = backend.linear({"lm_head": self.lm_head, **weights}, "lm_head", True)

    def _layer(self, i: int) -> tuple[torch.Tensor, Linear, Linear, torch.Tensor, Linear, Linear]:
        """Layer i's norms and matmuls, looked up once: (attn_norm, qkv, wo, mlp_norm,
        gate_up, down), each matmul a `Linear` over its float or quantized weight."""
        p = f"layers.{i}."
        wide = {"wqkv": True, "wo": False, "w_gate_up": True, "w_down": False}
        mm = {key: self.backend.linear(self.w, p + key, is_wide) for key, is_wide in wide.items()}
        norms = self.w[p + "attn_norm"], self.w[p + "mlp_norm"]
        return norms[0], mm["wqkv"], mm["wo"], norms[1], mm["w_gate_up"], mm["w_down"]

    def forward(self, batch: ForwardBatch, kv_caches: KvCaches) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]; writes this batch's K/V."""
        return self.backend.decoder(self, self.embed(batch.input_ids), batch, kv_caches)

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
        """Whether `logits` writes into the caller's buffer (the backend's say)."""
        return self.backend.logits_in_place

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in float32, into `out` ([N, vocab] float32) where
        `logits_in_place`.

        Vocabulary-parallel, every rank gets every rank's columns (all-gather) and samples the
        whole rows itself, the same tokens on each (sampling is keyed by seed and position):
        top-p, top-k, min-p, penalties and logprobs need whole rows, gathering them on rank 0
        alone moves the same bytes into rank 0, and the ranks then need no second collective
        to learn the sampled tokens."""
        local = self.backend.head(self, hidden, out)
        if self.ranks is None:
            return local
        whole = self.ranks.all_gather_columns(local)  # [N, padded vocab]
        vocab = self.cfg.vocab_size
        return whole if whole.shape[1] == vocab else whole[:, :vocab].contiguous()
