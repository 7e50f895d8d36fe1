"""What a front reads of the engine, as records: `EngineFacts` (fixed once the engine started)
and `EngineSnapshot` (its health, load and figures at one moment, between steps).

The server answers health and stats requests, bounds its queue and writes its stats line from
these records instead of reaching into the engine's scheduler, block manager or executor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from memstep.events.types import MemoryReport


@attrs.frozen(kw_only=True)
class EngineFacts:
    """The model and its limits, as the engine loaded them."""

    model: str  # the model's label (ModelSource.label)
    max_model_len: int
    vocab_size: int
    generation_config: str  # EngineConfig.generation_config: where sampling defaults come from
    # the SamplingParams fields a request leaves out take these (the model's own defaults)
    sampling_defaults: dict[str, Any]
    # each token id's fixed bytes (None: text by decoding; core/detokenizer.py)
    token_bytes: Sequence[bytes] | None


@attrs.frozen(kw_only=True)
class EngineSnapshot:
    """The engine between two steps."""

    facts: EngineFacts
    step: int  # the next step's number
    kind: str  # the state the executor last reported (a step kind, or a phase)
    has_work: bool  # a step would run something (or a recovery's next stage)
    is_recovering: bool  # a new executor is starting
    num_losses: int  # executors lost so far (names a recovery)
    death: str | None  # why the engine gave up on executors
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_requeues: int
    kv_pages_total: int
    kv_pages_used: int
    kv_pages_cached: int
    memory: MemoryReport | None  # the last step's memory report
    executor_pid: int  # 0: in this process, or none now
    standby_pid: int  # a loaded spare executor's process; 0: none


@attrs.frozen
class Admitted:
    """A request the engine queued (`Engine.add`), as its front needs it."""

    request_id: str  # the engine's id
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # those it resumed with (`add`'s output_token_ids)
    text: str  # their text, as the engine released it
