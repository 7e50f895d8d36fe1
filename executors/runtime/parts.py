"""What the worker takes from outside runtime/: the pieces that depend on the device (the model's
compute backend, the CUDA graphs and their bytes) or on the speculative method (an EAGLE head,
the spec decoder). `executors/process/assemble.py` picks them for a config, so that runtime/
imports neither cuda/ nor spec/."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from memstep.core.config import EngineConfig
from memstep.core.model_config import ModelConfig
from memstep.events.plan import MemoryPlan, PhaseFigures, SeqResult, StepPlan
from memstep.executors.model.kv_cache import KvCaches
from memstep.executors.model.llama import Backend, LlamaModel
from memstep.executors.model.weights import Weights
from memstep.executors.runtime.batch_builder import Feed
from memstep.executors.runtime.runner import Runner
from memstep.executors.runtime.running_requests import RunningRequests
from memstep.executors.runtime.sampler import Sampler
from memstep.states.kinds import Spec
from memstep.states.startup import Capture

# hidden states of the fed tokens and each feed's last row (`StepForward.forward`)
Forward = Callable[[list[Feed]], tuple[torch.Tensor, list[int]]]


class Head(Protocol):
    """An EAGLE head, loaded beside the target: its bytes are planned, its tensors metered."""

    @property
    def nbytes(self) -> int: ...

    def tensors(self) -> list[torch.Tensor]: ...


class StepDecoder(Protocol):
    """Runs the `spec` kind's steps (executors/spec/decoder.py)."""

    def run(self, plan: StepPlan) -> tuple[list[SeqResult], torch.Tensor]: ...

    def forget(self, request_id: str) -> None: ...


class ExecutorParts(Protocol):
    """The executor's parts for one config and device (`executors/process/assemble.py`)."""

    def backend(
        self,
        device: torch.device,
        model_cfg: ModelConfig,
        weights: Weights,
        kv_dtype: torch.dtype,
        one_rank: bool,
        bf16_products: bool,
    ) -> Backend:
        """The model's compute backend, chosen once, before the model is built."""
        ...

    def graph_bytes(
        self,
        cfg: EngineConfig,
        model_cfg: ModelConfig,
        blocks_per_seq: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> int:
        """What the captured graphs will hold (planned at profile); 0 where none are."""
        ...

    def capture(
        self,
        cfg: EngineConfig,
        model: LlamaModel,
        kv: KvCaches,
        sampler: Sampler,
        max_len: int,
        capture: Capture,
        memory_plan: MemoryPlan | None,
    ) -> tuple[Runner, PhaseFigures] | None:
        """The capture phase (its kind's buffers in `capture`): a runner of captured graphs and
        its figures, or None where steps stay eager (the CPU, a family whose layers are not
        fused)."""
        ...

    def draft_context(self, cfg: EngineConfig) -> int:
        """Slots a row of an EAGLE head's context (the `spec` kind's `draft_context`); 0: none."""
        ...

    def eagle_head(self, cfg: EngineConfig, model: LlamaModel) -> Head | None:
        """The EAGLE head of `speculative_method="eagle"`; None for other methods."""
        ...

    def spec_decoder(
        self,
        cfg: EngineConfig,
        model: LlamaModel,
        forward: Forward,
        requests: RunningRequests,
        sampler: Sampler,
        spec: Spec,
        head: Head | None,
        kv: KvCaches,
        weights: Weights,
        dtype: torch.dtype,
        max_len: int,
    ) -> StepDecoder:
        """The decoder of `spec` steps, over the target `model` (and, for
        `speculative_method="draft"`, a draft model of the target's first layers, over
        `weights`, or of its own), feeding through `forward`."""
        ...
