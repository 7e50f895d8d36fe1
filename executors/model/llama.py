"""The decoder over flattened token batches and a paged KV cache, for every family.

RMSNorm, rotary embeddings (with Llama-3, linear or LongRoPE scaling), grouped-query attention,
a gated MLP or routed experts, tied or separate output head; what a family adds (QKV bias, q/k
norms, windows, Gemma's norms and scales) is in its layers' records (`layers/block.py`), made
from its config's facts. A draft model is the same class running only the first N layers.
The model holds the weights, the rotary tables and the layer structure; its `Backend` does the
arithmetic: the torch reference (`torch_backend.py`), the CPU's C kernels (`executors/cpu/`) or
CUDA's Triton kernels and cuBLAS (`executors/cuda/`), chosen once where the model is built
(`executors/process/assemble.py`). The model never asks which device it runs on.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from memstep.core.model_config import ModelConfig
from memstep.executors.model.attention import ForwardBatch
from memstep.executors.model.kv_cache import KvCaches
from memstep.executors.model.layers import rotary
from memstep.executors.model.layers.block import Block, build_block
from memstep.executors.model.quant_linear import Linear
from memstep.executors.model.rank_group import RankGroup
from memstep.executors.model.weights import Weights


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
        self.scale = cfg.attn_scale
        device = weights["embed"].device
        freqs = rotary.angles(cfg, max_positions).to(device)
        factor = rotary.attention_factor(cfg)
        # [P, rope_dim / 2], as the fused kernels take them
        self.cos, self.sin = freqs.cos() * factor, freqs.sin() * factor
        self.rope_cos, self.rope_sin = rotary.halves(self.cos, self.sin)  # as apply_rope takes
        # each layer's rotary table (`Block.rope`): the global one, and windowed layers' own
        self.rope_tables = [(self.rope_cos, self.rope_sin)]
        if cfg.local_rope_theta is not None:
            local = rotary.angles(cfg, max_positions, local=True).to(device)
            self.rope_tables.append(rotary.halves(local.cos(), local.sin()))
        self.lm_head = weights.get("lm_head", weights["embed"])
        self.layers: list[Block] = [
            build_block(cfg, weights, i, lambda name, wide: backend.linear(weights, name, wide))
            for i in range(self.num_layers)
        ]
        self.head = backend.linear({"lm_head": self.lm_head, **weights}, "lm_head", True)

    def forward(self, batch: ForwardBatch, kv_caches: KvCaches) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]; writes this batch's K/V."""
        return self.backend.decoder(self, self.embed(batch.input_ids), batch, kv_caches)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden]. Vocabulary-parallel: each rank looks up the ids of its
        slice (others give zero rows) and the ranks sum: one all-reduce of [T, hidden]."""
        table = self.w["embed"]
        if self.ranks is None:
            h = F.embedding(ids, table)
            if self.cfg.embed_scale != 1.0:  # in the table's dtype, as transformers scales
                h = h * torch.tensor(self.cfg.embed_scale, dtype=h.dtype)
            return h
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
