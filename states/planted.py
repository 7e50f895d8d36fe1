"""Deliberate leaks, for proving that the leak checks fire (`debug_plant_leak` in the config).

Each reproduces one production incident.  They are chosen by config so that a log recorded with
a plant replays with the same plant and the same leak report.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memstep.states.kinds import KindEnv, NoSpec, StepKind, StepOutputs


class NoSpecKeepsHiddenStates(NoSpec):
    """The speculative worker's bug: on the path where speculation is disabled by batch size,
    `previous_hidden_states` is kept on `self` (growing each step) and never given back."""

    def __init__(self, env):
        super().__init__(env)
        self.previous_hidden_states: list[torch.Tensor] = []

    def after_step(self, outputs: StepOutputs) -> None:
        self.previous_hidden_states.append(outputs.hidden.clone())


class SamplerScratchPerStep(NoSpec):
    """The sampler-fragmentation bug: scratch for the sampler allocated per step at the batch
    size of the step, outside any persistent buffer, and kept by a cache that never shrinks."""

    def __init__(self, env):
        super().__init__(env)
        self.scratch: list[torch.Tensor] = []

    def after_step(self, outputs: StepOutputs) -> None:
        vocab = self.env.model.vocab_size
        self.scratch.append(torch.empty(outputs.num_rows, vocab, device=outputs.hidden.device))


class ScratchOfChangingSizes(NoSpec):
    """Fragmentation without a leak: scratch allocated per step outside the planned memory,
    64 MiB larger each step, and freed at once.  Live bytes stay flat, but once the size passes
    the largest block the allocator has cached (within a few steps), it has to reserve more:
    its reserved bytes (and, without expandable segments, its segments) grow every step."""

    def __init__(self, env):
        super().__init__(env)
        self.num_steps = 0

    def after_step(self, outputs: StepOutputs) -> None:
        self.num_steps += 1
        device = outputs.hidden.device
        unit = 64 << 20 if device.type == "cuda" else 64 << 10  # the CPU has no cache to grow
        scratch = torch.empty(self.num_steps * unit, dtype=torch.uint8, device=device)
        del scratch


class ExecutorKeepsRequestBytes(NoSpec):
    """A host leak no tensor figure shows: the executor keeps 4 MiB of Python bytes for every
    request it admits (a per-request cache that is never evicted)."""

    NBYTES = 4 << 20

    def __init__(self, env):
        super().__init__(env)
        self.kept: list[bytes] = []

    def after_step(self, outputs: StepOutputs) -> None:
        for _ in range(outputs.num_admitted):
            self.kept.append(bytes([len(self.kept) % 251 + 1]) * self.NBYTES)  # touched pages


class ExecutorKeepsRequestBytesSlowly(ExecutorKeepsRequestBytes):
    """The slow host leak of long-running servers: 256 KiB kept per request, which stays under
    any fixed tolerance for hours of traffic."""

    NBYTES = 256 << 10


class ExecutorKeepsRequestObjects(NoSpec):
    """Python objects kept per request (a request's bookkeeping in a dict never cleaned): 4,096
    small dicts, about 1 MiB of the Python heap a request, in no tensor."""

    NUM_OBJECTS = 4096

    def __init__(self, env):
        super().__init__(env)
        self.kept: list[list[dict]] = []

    def after_step(self, outputs: StepOutputs) -> None:
        for _ in range(outputs.num_admitted):
            n = len(self.kept)
            objects = [{"request": n, "token": i, "text": f"t{i}"} for i in range(self.NUM_OBJECTS)]
            self.kept.append(objects)


class NoSpecKeepsATensorEvery100Steps(NoSpec):
    """A slow device leak: one step's hidden states kept every 100th step, so that the figure
    rises in rare steps, each like a high-water mark, and is a slope only over many."""

    EVERY = 100

    def __init__(self, env):
        super().__init__(env)
        self.num_steps = 0
        self.kept: list[torch.Tensor] = []

    def after_step(self, outputs: StepOutputs) -> None:
        self.num_steps += 1
        if self.num_steps % self.EVERY == 0:
            self.kept.append(outputs.hidden.clone())


class NoSpecFeedsSpecHolder(NoSpec):
    """The seed incident in its own shape: with EAGLE the `spec` kind holds the requests' hidden
    states, and the path where speculation is disabled by batch size still appends each step's
    hidden states to that holder (`spec.previous_hidden_states`), which nothing frees while
    `spec` is off, nor when it exits."""

    def __init__(self, env, kinds: dict[str, StepKind]):
        super().__init__(env)
        self.spec = kinds["spec"]
        self.spec.previous_hidden_states = []  # type: ignore[attr-defined]

    def after_step(self, outputs: StepOutputs) -> None:
        self.spec.previous_hidden_states.append(outputs.hidden.clone())  # type: ignore[attr-defined]


def _alone(cls: type[StepKind]) -> Callable[[KindEnv, dict[str, StepKind]], StepKind]:
    return lambda env, kinds: cls(env)


# name -> (the kind it stands in for, its factory over the env and the other kinds)
PLANTS: dict[str, tuple[str, Callable[[KindEnv, dict[str, StepKind]], StepKind]]] = {
    "no_spec_hidden_states": ("no_spec", _alone(NoSpecKeepsHiddenStates)),
    "spec_holder_hidden_states": ("no_spec", NoSpecFeedsSpecHolder),
    "sampler_scratch": ("no_spec", _alone(SamplerScratchPerStep)),
    "fragmenting_scratch": ("no_spec", _alone(ScratchOfChangingSizes)),
    "executor_host_bytes": ("no_spec", _alone(ExecutorKeepsRequestBytes)),
    "executor_host_bytes_slow": ("no_spec", _alone(ExecutorKeepsRequestBytesSlowly)),
    "executor_python_objects": ("no_spec", _alone(ExecutorKeepsRequestObjects)),
    "tensor_every_100_steps": ("no_spec", _alone(NoSpecKeepsATensorEvery100Steps)),
}

# plants a device cannot show, and why (the engine refuses to start with them there)
REFUSED = {
    ("fragmenting_scratch", "cpu"): (
        "fragmenting_scratch needs CUDA's caching allocator: on the CPU a freed tensor goes back "
        "to malloc and no allocator cache keeps memory reserved beyond the live tensors "
        "(reserved bytes equal live bytes), so scratch of changing sizes cannot fragment it; "
        "run it with --device cuda"
    ),
}


def refusal(plant: str | None, device_type: str) -> str | None:
    """Why `plant` cannot be planted on `device_type`, or None where it can."""
    return REFUSED.get((plant or "", device_type))
