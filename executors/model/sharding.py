"""Megatron-style tensor-parallel shards of memstep's weights, one rank's piece at a time.

Column-parallel (each rank keeps a slice of the output rows, no communication): the fused qkv
(its share of the query heads and of the KV heads, so its KV pages hold only those heads) and
the fused gate/up (its slice of the MLP width).  Row-parallel (each rank keeps the matching
slice of the input columns; the partial sums are all-reduced): the attention output `wo` and
`w_down`.  Vocabulary-parallel: the embedding and the head keep rows [r*S, (r+1)*S) of the
vocabulary padded to a multiple of the ranks (S = `vocab_shard_size`; padding rows are zero).
Norms are replicated.

`shard` takes one full tensor and returns a new, contiguous piece, so that the full tensor can be
freed before the next one is made: a rank never holds more than one whole matrix.
"""

from __future__ import annotations

import attrs
import torch

from memstep.core.model_config import ModelConfig
from memstep.core.shapes import vocab_shard_size


@attrs.frozen
class Shard:
    """Rank `rank` of `size`, for a model of (whole) shapes `model`."""

    model: ModelConfig
    rank: int = 0
    size: int = 1

    def __call__(self, name: str, w: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return w
        kind = name.rsplit(".", 1)[-1]
        if kind == "wqkv":
            return self._qkv(w)
        if kind == "w_gate_up":
            return torch.cat([self._piece(half, 0) for half in w.chunk(2, dim=0)]).contiguous()
        if kind in ("wo", "w_down"):
            return self._piece(w, 1).contiguous()
        if kind in ("embed", "lm_head"):
            return self._vocab_rows(w)
        return w

    @property
    def vocab_start(self) -> int:
        return self.rank * vocab_shard_size(self.model, self.size)

    def _piece(self, w: torch.Tensor, dim: int) -> torch.Tensor:
        return w.chunk(self.size, dim=dim)[self.rank]

    def _qkv(self, w: torch.Tensor) -> torch.Tensor:
        m = self.model
        q, k, v = w.split([m.num_heads * m.head_dim, *[m.num_kv_heads * m.head_dim] * 2])
        return torch.cat([self._piece(q, 0), self._piece(k, 0), self._piece(v, 0)]).contiguous()

    def _vocab_rows(self, w: torch.Tensor) -> torch.Tensor:
        rows = vocab_shard_size(self.model, self.size)
        start = self.vocab_start
        out = torch.zeros(rows, w.shape[1], dtype=w.dtype, device=w.device)
        piece = w[start : start + rows]
        out[: piece.shape[0]] = piece
        return out
