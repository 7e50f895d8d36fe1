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
from memstep.executors.runtime.prompt_scorer import PromptScorer
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


class ScoredForward:
    """The worker's forward, which the spec decoder feeds through too: `runner`'s (eager, then
    the captured graphs from capture on), with the prompt chunks of requests that asked for
    prompt logprobs scored from its hidden states."""

    def __init__(self, runner: Runner, prompts: PromptScorer):
        self.runner, self.prompts = runner, prompts

    def forward(self, feeds: list[Feed], ahead: bool = False) -> tuple[torch.Tensor, list[int]]:
        """Hidden states of the fed tokens and each feed's last row (`Runner.forward`); a step
        that scores prompt tokens needs their every row, so it takes nothing replayed ahead."""
        if not self.prompts.wanted(feeds):
            return self.runner.forward(feeds, ahead)
        hidden, last_rows = self.runner.forward(feeds, False)
        self.prompts.score(feeds, hidden, last_rows)
        return hidden, last_rows
