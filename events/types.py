"""Every typed record memstep writes to its log, sends between processes, or replays.

One frozen attrs class per record, registered by name with `record`, so that the codec in
`events/codec.py` can encode and decode any of them without pickling.  Inputs are the records a
replay feeds back in (EngineStarted, RequestAdded, RequestAborted); everything else is derived
and is compared field by field on replay.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

REGISTRY: dict[str, type] = {}


def record(cls: type) -> type:
    """Freeze `cls` as an attrs class and register it under its class name."""
    frozen = attrs.frozen(cls)
    REGISTRY[frozen.__name__] = frozen
    return frozen


# --- shared pieces -------------------------------------------------------------------------


@record
class MemoryReport:
    """Real memory figures measured after a step, independent of the arena's bookkeeping."""

    live_bytes: int  # CPU: bytes of all live tensor storages; CUDA: memory_allocated
    reserved_bytes: int  # CUDA: memory_reserved; CPU: equal to live_bytes
    num_segments: int  # CUDA: allocator segments; CPU: number of live storages
    num_allocs: int  # CUDA: cumulative allocation count; CPU: 0
    arena_claimed_bytes: int  # bytes the arena ledger says are claimed by step kinds
    kv_pages_used: int


@record
class LedgerEntry:
    """One line of the arena ledger: who holds which buffer since when."""

    owner: str
    buffer: str
    nbytes: int
    step_claimed: int


# --- inputs --------------------------------------------------------------------------------


@record
class EngineStarted:
    memstep_version: str
    config: dict  # EngineConfig.to_dict()
    model_identity: str  # e.g. "gguf:<sha256 prefix>" or "random:tiny:seed=0"
    INPUT: ClassVar[bool] = True


@record
class RequestAdded:
    step: int
    request_id: str
    prompt_token_ids: list[int]
    params: dict  # SamplingParams.to_dict()
    arrival_time: float
    INPUT: ClassVar[bool] = True


@record
class RequestAborted:
    step: int
    request_id: str
    INPUT: ClassVar[bool] = True


# --- derived -------------------------------------------------------------------------------


@record
class PhaseChanged:
    step: int
    old: str
    new: str


@record
class StepPlanned:
    step: int
    kind: str
    batch: list[list]  # [[request_id, num_tokens_scheduled], ...]
    num_tokens: int


@record
class StateExited:
    step: int
    kind: str
    bytes_released: int
    ledger: list[LedgerEntry]  # ledger after the exit hook ran


@record
class StateEntered:
    step: int
    kind: str
    bytes_claimed: int
    ledger: list[LedgerEntry]  # ledger after the enter hook ran


@record
class StepFinished:
    step: int
    kind: str
    sampled: list[list]  # [[request_id, [token ids appended this step]], ...]
    num_proposed: int
    num_accepted: int
    memory: MemoryReport


@record
class RequestFinished:
    step: int
    request_id: str
    reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int


@record
class LeakSuspected:
    step: int  # step where the growth began
    kind: str
    what: str  # "live_growth" | "fragmentation" | "held_after_exit"
    nbytes: int
    detail: str


def is_input(rec: object) -> bool:
    return bool(getattr(type(rec), "INPUT", False))
