"""An EAGLE head loaded for serving: its file read and checked against the target, and the
backend that runs it (torch or the CPU's C kernels) chosen once."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from memstep.core.config import ConfigError
from memstep.executors.spec import eagle_cpu
from memstep.executors.spec.eagle import ATTENTION, CONTEXT, MATRICES, AttnShape, Rotation
from memstep.executors.spec.eagle_cpu import CpuHead
from memstep.executors.spec.eagle_torch import TorchHead
from memstep.states.arena import tensor_bytes


class HeadBackend(Protocol):
    """What runs a head: the keys of pairs read into a request's context, and drafts."""

    def tensors(self) -> list[torch.Tensor]: ...

    def keys(
        self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def write_pairs(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        context: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
    ) -> None: ...

    def draft_rows(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        k: int,
        context: torch.Tensor,
        rows: list[int],
        counts: list[int],
    ) -> torch.Tensor: ...


class EagleHead:
    """A trained head over a target's embedding and output head, in the target's device and
    dtype. Owns its small matrices and the rows of the target's head for its vocabulary.

    With the attention half (`attn`), each request's context is the keys and values of the
    pairs (the target's hidden state, the token it chose) that the head has read, held by the
    `spec` kind (`draft_context`, [rows, 2, slots, kv heads, head dim]); `write_pairs` writes
    them and `draft_rows` attends them, through its backend (`HeadBackend`): on the CPU (`int8`
    left None) such a head runs in the C kernels (eagle_cpu.py); else through torch
    (eagle_torch.py: in float, or int8 rows with `int8`)."""

    def __init__(
        self,
        path: Path,
        embed: torch.Tensor,
        head: torch.Tensor,
        vocab_size: int,
        eps: float,
        kv_shape: tuple[int, int] | None = None,
        int8: bool | None = None,
        max_positions: int = 4096,
    ):
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
        missing = [n for n in (*MATRICES, "vocab", "meta_hidden", "meta_vocab") if n not in arrays]
        if missing:
            raise ConfigError(f"{path.name} is not a draft head: it lacks {missing}")
        hidden, target_vocab = int(arrays["meta_hidden"]), int(arrays["meta_vocab"])
        if hidden != embed.shape[1] or target_vocab != vocab_size:
            raise ConfigError(
                f"{path.name} was trained for hidden size {hidden} and vocabulary {target_vocab}, "
                f"not this model's {embed.shape[1]} and {vocab_size}"
            )
        self.attn: AttnShape | None = None
        # trained with the prompt's pairs in its context (`train-draft --prompt-context`)
        self.reads_prompt = "q" in arrays and bool(arrays.get("meta_prompt_context", 0))
        names = list(MATRICES)
        if "q" in arrays:
            meta = [arrays["meta_" + n] for n in ("heads", "kv_heads", "head_dim", "rope_theta")]
            self.attn = AttnShape(*(int(x) for x in meta), window=CONTEXT)  # type: ignore[misc]
            if kv_shape is not None and (self.attn.kv_heads, self.attn.head_dim) != kv_shape:
                raise ConfigError(f"{path.name}'s attention does not match this model's heads")
            names += ATTENTION
        device, dtype = embed.device, embed.dtype
        params = {n: torch.from_numpy(arrays[n]).to(device=device, dtype=dtype) for n in names}
        self.vocab = torch.from_numpy(arrays["vocab"]).to(device=device, dtype=torch.long)
        self.embed = embed
        self.eps = eps
        self.table: Rotation | None = None  # cos and sin [max_positions, 1, d / 2]
        if self.attn is not None:
            self.table = self.attn.rotation(torch.arange(max_positions, device=device), dtype)
        rows = head[self.vocab].contiguous()  # the target's head over the draft vocabulary
        self.backend = self._backend(params, rows, device, int8)

    def _backend(
        self, params: dict[str, torch.Tensor], rows: torch.Tensor, device, int8: bool | None
    ) -> HeadBackend:
        """On the CPU by default, a head with attention runs in the C kernels (eagle_cpu.py)
        where they take its shapes; else torch, in int8 rows on the CPU unless told."""
        attn, table = self.attn, self.table
        on_cpu = int8 is None and device.type == "cpu"
        if (
            on_cpu
            and attn is not None
            and table is not None
            and eagle_cpu.takes(params, attn.head_dim)
        ):
            shape = (attn.heads, attn.kv_heads, attn.head_dim)
            return CpuHead(
                params, rows, shape, self.eps, table, self.embed, self.vocab, attn.window
            )
        int8 = device.type == "cpu" if int8 is None else int8
        return TorchHead(params, rows, self.embed, self.vocab, attn, table, self.eps, int8)

    def tensors(self) -> list[torch.Tensor]:
        table = list(self.table) if self.table is not None else []
        return [self.vocab, *self.backend.tensors(), *table]

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def keys(
        self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [N, kv heads, d] of N pairs (hidden state, the token it chose) at
        their context positions [N]: what the context holds of them."""
        return self.backend.keys(hidden, tokens, positions)

    def write_pairs(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        context: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """The keys and values of N pairs at their context positions [N] written into
        `context` ([rows, 2, slots, kv heads, d], the `spec` kind's `draft_context`) at (row,
        slot) [N] each."""
        self.backend.write_pairs(hidden, tokens, positions, context, rows, slots)

    def draft_rows(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        k: int,
        context: torch.Tensor | None,
        rows: list[int],
        counts: list[int],
    ) -> torch.Tensor:
        """[B, k] greedy drafts (target ids) for B requests from their last states [B, H] and
        tokens [B], their pairs in `context` (the `spec` kind's `draft_context`, None without
        attention) rows `rows`, `counts` pairs read each."""
        if context is None or self.attn is None:
            assert isinstance(self.backend, TorchHead)
            return self.backend.draft(hidden, tokens, k)
        return self.backend.draft_rows(hidden, tokens, k, context, rows, counts)

    def draft_tree(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        parents: tuple[int, ...],
        context: torch.Tensor | None,
        rows: list[int],
        counts: list[int],
    ) -> torch.Tensor:
        """`draft_rows` for a static draft tree of `parents` (`core/spec_tree.py`): [B, nodes]
        target ids, each node's children the head's top candidates after it. Through torch
        only: a head loaded for trees is (`eagle_head`, int8 rows on the CPU)."""
        assert isinstance(self.backend, TorchHead), "tree drafting runs on the torch head"
        return self.backend.draft_tree_rows(hidden, tokens, parents, context, rows, counts)
