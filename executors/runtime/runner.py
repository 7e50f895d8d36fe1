"""How a step's feeds become hidden states: the interface the worker calls once a step, and its
eager form (the CPU; CUDA before capture). CUDA's `GraphRunner` (executors/cuda/graph_runner.py)
is the other: decode graphs, the decode step replayed ahead, piecewise graphs, eager last."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from memstep.executors.model.kv_cache import KvCaches
from memstep.executors.model.llama import LlamaModel
from memstep.executors.runtime.batch_builder import Feed, build_batch
from memstep.executors.runtime.sampler import PendingTokens


class Runner(Protocol):
    def forward(self, feeds: Sequence[Feed], ahead: bool) -> tuple[torch.Tensor, list[int]]:
        """Hidden states of the fed tokens and each feed's last row. With `ahead`, feeds that a
        replay ahead already ran take their rows from it and the states hold each feed's last
        row and no other (a plain step samples nothing else); without, any replay ahead is
        dropped. The states may be a view of a static buffer, valid until the next forward."""
        ...

    def run_ahead(self, feeds: Sequence[Feed], tokens: PendingTokens) -> None:
        """After a step whose `feeds` all sampled (`tokens`, still on the device): run the
        decode step after it, if this runner can, before its plan comes."""
        ...


class EagerRunner:
    """Every step through the model's forward, nothing run ahead."""

    def __init__(self, model: LlamaModel, kv_caches: KvCaches, block_size: int):
        self.model, self.kv, self.block_size = model, kv_caches, block_size
        self.device = model.w["embed"].device

    def forward(self, feeds: Sequence[Feed], ahead: bool = False) -> tuple[torch.Tensor, list[int]]:
        batch, last_rows = build_batch(list(feeds), self.block_size, self.device)
        return self.model.forward(batch, self.kv), last_rows

    def run_ahead(self, feeds: Sequence[Feed], tokens: PendingTokens) -> None:
        return None
