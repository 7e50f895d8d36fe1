"""Every typed record memstep writes to its log, sends between processes, or replays.

One frozen attrs class per record, registered by name with `record`, so that the codec in
`events/codec.py` can encode and decode any of them without pickling.  Inputs are the records a
replay feeds back in (EngineStarted, RequestAdded, RequestAborted, ExecutorLost, RequestResumed,
RequestNamed, SpecThresholdChanged); observations (`OBSERVED`: what a server measured around the
engine, such as a request's latencies) are neither fed back nor reproduced; everything else is
derived and is compared field by field on replay, except the fields a record names in
`WALL_CLOCK` (durations that no replay can reproduce).
"""

from __future__ import annotations

from typing import ClassVar, TypeVar

import attrs

from memstep.events.sampling_params import SamplingParams

T = TypeVar("T", bound=type)
REGISTRY: dict[str, type] = {}


def record(cls: type) -> type:
    """Freeze `cls` as an attrs class and register it under its class name."""
    return registered(attrs.frozen(cls))


def registered(cls: T) -> T:
    """Register `cls`, an attrs class made elsewhere (one built by keyword only, say), under its
    class name, so that the codec carries it as it carries a `record`."""
    REGISTRY[cls.__name__] = cls
    return cls


ROW_RECORDS: set[type] = set()  # records that travel as rows inside a list field (`row_record`)


def row_record(cls: type) -> type:
    """`record`, and in a list field of another record it travels as a row: a msgpack array
    of its values in field order, no type tag or keys (a step's thousand sequences decode in
    half the time). On its own it is a tagged map as any record."""
    frozen = record(cls)
    ROW_RECORDS.add(frozen)
    return frozen


# --- shared pieces -------------------------------------------------------------------------

registered(SamplingParams)  # built by keyword, in its own module; in requests' inputs and plans


@record
class MemoryReport:
    """Real memory figures measured after a step, independent of the arena's bookkeeping."""

    live_bytes: int  # CPU: bytes of all live tensor storages; CUDA: memory_allocated
    reserved_bytes: int  # CUDA: memory_reserved; CPU: equal to live_bytes
    num_segments: int  # CUDA: allocator segments; CPU: number of live storages
    num_allocs: int  # CUDA: cumulative allocation count; CPU: 0
    arena_claimed_bytes: int  # bytes the arena ledger says are claimed by step kinds
    kv_pages_used: int  # held by requests
    kv_pages_cached: int = 0  # held by none, caching a prefix block: reclaimable KV, not a leak
    executor_rss_bytes: int = 0  # host: the executor process's resident bytes (0: not measured)
    core_rss_bytes: int = 0  # host: the engine core's (the same process for an in-process one)
    # host: the executor's compiled grammar matchers (estimated) and the core's constraint
    # verdicts, each within its cache's budget (docs/limits.md)
    grammar_cache_bytes: int = 0
    constraint_cache_bytes: int = 0
    # the OS's figures, moved by everything else on the host, and caches that a recovered or
    # replaying process holds afresh: no replay can reproduce them
    HOST_MEASURED: ClassVar[tuple[str, ...]] = (
        "executor_rss_bytes",
        "core_rss_bytes",
        "grammar_cache_bytes",
        "constraint_cache_bytes",
    )


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
    params: SamplingParams  # a dict (SamplingParams.to_dict()) in logs before format 4
    arrival_time: float
    INPUT: ClassVar[bool] = True


@record
class RequestAborted:
    step: int
    request_id: str
    INPUT: ClassVar[bool] = True


@record
class ExecutorLost:
    """The executor died, stopped beating or answered with an error.  An input: replay cannot
    cause the death, so it applies the recorded one where it happened."""

    step: int
    reason: str  # e.g. "executor process 123 died (killed by SIGKILL)"
    during: str  # "idle" (between steps), "step" (running `step`), "start" or a phase name
    gave_up: bool  # past the restart limit: every request failed, the engine is dead
    INPUT: ClassVar[bool] = True


@record
class RequestResumed:
    """A request that an earlier server's log left unfinished, re-admitted by `serve --resume`
    with the tokens it had produced: recomputed and sampled on from there, as after an executor
    loss, so it goes on as it would have without the crash (its seed is in `params`)."""

    step: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # with the seed the earlier engine recorded
    output_token_ids: list[int]  # produced before the crash
    arrival_time: float
    INPUT: ClassVar[bool] = True


@record
class RequestNamed:
    """The id a client gave a request (the engine's id is its own), recorded by the server so
    that after a crash `serve --resume` can hand the request back to that client.  An input that
    changes nothing in the engine: replay passes over it."""

    step: int
    request_id: str
    client_id: str
    INPUT: ClassVar[bool] = True


@record
class SpecThresholdChanged:
    """The batch size from which the engine itself turned speculation off changed
    (core/spec_threshold.py): `spec` runs while a batch is smaller than `threshold` (None: at
    every size). Chosen from step costs measured in wall time, which no replay can measure
    again: an input, applied by a replay where it was recorded."""

    step: int
    threshold: int | None
    rates: list[list]  # [[bucket, spec tok/s, no_spec tok/s], ...] of the buckets judged
    # [[bucket, gap], ...]: the first probe gaps made from `rates`, where past the period
    # (core/spec_threshold.py `probe_gaps`); a log before format 5 has none: the period
    probe_gaps: list[list] = attrs.Factory(list)
    INPUT: ClassVar[bool] = True


# --- derived -------------------------------------------------------------------------------


@record
class DraftLengthChanged:
    """A request's K changed (core/draft_length.py): dropped after its drafts kept failing,
    raised after all of a step's were accepted."""

    step: int
    request_id: str
    old: int
    new: int


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
    # admissions that reused cached pages: [[request_id, num_cached_tokens, [page, ...]], ...]
    cached: list[list] = attrs.Factory(list)


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
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache


@record
class RequestPreempted:
    """A running request sent back to the queue with its KV pages freed, to be recomputed from
    its prompt and tokens when it is admitted again: by the scheduler, to make room for others
    (`cause` "preemption"), or by an executor loss (`cause` "recovery", before RecoveryStarted).
    Derived, so replay reproduces it.  Logs of format 1 have none (`SINCE_FORMAT`)."""

    step: int
    request_id: str
    cause: str  # "preemption" | "recovery"
    num_tokens: int  # prompt + produced tokens, whose KV it recomputes
    SINCE_FORMAT: ClassVar[int] = 2


@record
class LeakSuspected:
    step: int  # step where the growth began
    kind: str
    # a leak: "live_growth" | "fragmentation" | "held_after_exit" | "host_growth"; information,
    # not a leak (a figure rose once and stays: a high-water mark): "high_water" | "host_high_water"
    what: str
    nbytes: int
    detail: str

    @property
    def is_leak(self) -> bool:
        return self.what not in HIGH_WATER


HIGH_WATER = ("high_water", "host_high_water")


@record
class RecoveryStarted:
    """The engine entered `recover` and put every unfinished request back in the queue."""

    step: int
    num_losses: int  # executors lost since the engine started, this one included
    num_readmitted: int  # requests that were running (recomputed from their prompt and tokens)
    num_waiting: int  # every unfinished request, queued in its order
    tokens_to_recompute: int  # prompt + produced tokens of the re-admitted requests


@record
class RecoveryDone:
    """A new executor is profiled, warmed up and captured; serving continues."""

    step: int
    num_readmitted: int
    tokens_to_recompute: int
    num_starts: int  # executors started during this recovery (more than one: a start died)
    seconds: float  # from the loss to the executor ready for the next step
    WALL_CLOCK: ClassVar[tuple[str, ...]] = ("seconds",)


@record
class RequestTimed:
    """A request's latencies as the API server measured them (seconds since it received the
    request), written beside its RequestFinished so that a log keeps the run's TTFT and end-to-end
    times for a traffic replay to compare with.  Wall time: an observation, not derived."""

    step: int
    request_id: str
    reason: str  # the server's end of the request: a finish reason, "disconnect" or an error
    ttft_s: float | None  # the first token; None when none was produced
    e2e_s: float
    queue_s: float | None  # first scheduled into a step; None when never scheduled
    OBSERVED: ClassVar[bool] = True


@record
class RecordsLost:
    """Records the recorder could not write (a full disk, `--on-log-error continue`), written
    once it can write again: the log has a gap here, and nothing after it replays exactly."""

    step: int  # the engine's step when writing worked again
    num_records: int
    first_step: int  # the step of the first record lost
    last_step: int  # the step of the last record lost
    reason: str  # the write error
    OBSERVED: ClassVar[bool] = True


@record
class InputMark:
    """Written by the log before each input record: the input's place among the log's inputs
    and the CRC of its bytes, so that an input duplicated, reordered or taken out is refused when
    the log is read (`events/input_marks.py`).  The reader takes the marks out."""

    seq: int
    crc: int
    OBSERVED: ClassVar[bool] = True  # the log's own, never fed back nor reproduced
    SINCE_FORMAT: ClassVar[int] = 3


def is_input(rec: object) -> bool:
    return bool(getattr(type(rec), "INPUT", False))


def is_derived(rec: object) -> bool:
    """Emitted by the engine from its inputs, so a replay emits it again."""
    return not (is_input(rec) or getattr(type(rec), "OBSERVED", False))


def in_format(rec: object, format_version: int) -> bool:
    """Whether a log of `format_version` holds records of `rec`'s type: a replay of an older log
    compares only the records that log could hold."""
    return int(getattr(type(rec), "SINCE_FORMAT", 1)) <= format_version


def unreplayable_fields(cls: type) -> tuple[str, ...]:
    """Fields of `cls` no replay can reproduce: wall-clock durations, host memory figures."""
    return (*getattr(cls, "WALL_CLOCK", ()), *getattr(cls, "HOST_MEASURED", ()))


def is_host_measured(rec: object) -> bool:
    """A record made from host memory figures alone (a host-growth report): replay compares
    none, since the OS's figures differ from run to run."""
    return isinstance(rec, LeakSuspected) and rec.what in ("host_growth", "host_high_water")


def is_leak(rec: object) -> bool:
    """A leak report (a high-water mark is a LeakSuspected record too, but information only)."""
    return isinstance(rec, LeakSuspected) and rec.is_leak
