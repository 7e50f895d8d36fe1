"""Deterministic replay: rebuild the recorded engine and feed it the recorded inputs.

The engine's step counter advances only when a step runs, so each input is applied right before
the step whose number it was recorded at, exactly as it arrived in the recorded run.  Scheduling
depends only on step numbers and sampling only on (seed, position), so an unchanged engine emits
the recorded derived records again, byte for byte.

A what-if run (config overrides) may finish requests sooner or later than the recording did.  When
it goes idle before the next input's step, that input is applied at once (counted in
`inputs_shifted`); an input that no longer applies (aborting a request that already finished, a
request the new config refuses) is skipped with the reason.

The automatic speculation threshold is chosen from step costs measured in wall time: the replay
measures none and applies each recorded change (`SpecThresholdChanged`) at its step instead.

A recorded executor loss is an input too: replay cannot cause it, so the replay's executors
(`_ScriptedLosses`) raise the recorded loss where it happened (between steps, in a step, or
while a new executor starts) and the engine records it and recovers as it did.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine, UnknownRequest
from memstep.core.recovery import EngineDead, ExecutorDown
from memstep.core.sampling_params import InvalidRequest
from memstep.events.plan import PhaseReply, StepPlan, StepResult
from memstep.events.types import (
    EngineStarted,
    ExecutorLost,
    RequestAborted,
    RequestAdded,
    RequestNamed,
    RequestResumed,
    SpecThresholdChanged,
    is_derived,
)
from memstep.executors.process.inprocess import InProcessExecutor
from memstep.replay.recording import Recording

# the replayed executor's host-memory tolerance: none. The OS's figures are left out of the
# comparison (no replay repeats them), and an executor in this process would count the records
# the replay keeps for it as its own growth (+64 MiB by step 5,969 of a 3,600-request log)
UNWATCHED_MIB = 1 << 40


class ReplayStalled(RuntimeError):
    """The replayed engine has work but cannot run a step, and no input is left to change that."""


@attrs.frozen
class ReplayRun:
    """What the replayed engine did: every record it emitted, and the inputs it could not take."""

    config: EngineConfig
    model_identity: str
    records: list[object]
    skipped: list[str]  # "step N: <input>: <why>"
    inputs_shifted: int  # inputs applied before their recorded step (engine idle earlier)
    stopped_at_step: int | None  # damaged or unfinished log: replay stopped after this step
    # inputs the engine refused: the recorded one took every input it recorded, so in a plain
    # replay each is an input the log holds that no engine took (a duplicated RequestAdded)
    inputs_refused: int = 0

    @property
    def derived(self) -> list[object]:
        return [r for r in self.records if is_derived(r)]


def replay(
    recording: Recording,
    overrides: dict[str, Any] | None = None,
    executor_factory: Callable = InProcessExecutor,
    sinks: tuple[Callable[[object], None], ...] = (),
) -> ReplayRun:
    """Replay `recording` through a fresh engine built from its header's config (+ `overrides`).

    A damaged or unfinished log is replayed up to the last step it recorded (a what-if run goes
    on until its inputs are served); a corrupt one only up to its first gap, since a lost record
    may have been an input.  The engine is shut down when the recorded one was; otherwise its
    shutdown records are not collected.  `sinks` see every record too (a progress bar).
    """
    recording = recording.before_damage()
    cfg = EngineConfig.from_dict({**recording.config, **(overrides or {})})
    records: list[object] = []
    feeder = _Feeder(recording.inputs)
    scripted = _ScriptedLosses(feeder.pending, executor_factory)
    engine = Engine(
        cfg, scripted.start, sinks=[records.append, *sinks], decides_spec_threshold=False
    )
    stop = None if recording.is_complete or overrides else recording.last_step
    try:
        _run(engine, feeder, stop)
        if not recording.was_shut_down:
            engine.sinks.clear()
    finally:
        engine.shutdown()
    started = records[0]
    assert isinstance(started, EngineStarted)
    return ReplayRun(
        cfg, started.model_identity, records, feeder.skipped, feeder.shifted, stop, feeder.refused
    )


def _run(engine: Engine, feeder: _Feeder, stop: int | None) -> None:
    while True:
        if not engine.is_recovering:  # inputs that came during a recovery were queued after it
            feeder.apply_due(engine)
        if stop is not None and engine.step_no > stop:
            return
        if engine.has_work():
            before, recovering = engine.step_no, engine.is_recovering
            try:
                engine.step()
            except EngineDead:
                return  # the recorded engine gave up here too
            if engine.step_no > before or recovering or engine.is_recovering:
                continue
            if not feeder.pending:
                raise ReplayStalled(f"step {before}: the engine has work but schedules nothing")
        elif not feeder.pending:
            return
        feeder.apply_next(engine)


class _Feeder:
    """The recorded inputs still to apply, in order; applies them to an engine."""

    def __init__(self, inputs: list[object]):
        self.pending: deque[object] = deque(inputs)
        self.skipped: list[str] = []
        self.shifted = 0
        self.refused = 0  # request inputs the engine refused (`skipped` says why)

    def apply_due(self, engine: Engine) -> None:
        """Apply every input recorded at (or, after a divergence, before) this step, up to a
        loss in a step or a start: the executors raise those when the engine gets there."""
        while self.pending and _step_of(self.pending[0]) <= engine.step_no:
            head = self.pending[0]
            if isinstance(head, ExecutorLost):
                if head.during != "idle":
                    return
                with contextlib.suppress(EngineDead):  # a loss past the budget: dead here too
                    engine.check_executor()  # the executor raises the recorded loss
                if self.pending and self.pending[0] is head:  # no executor to lose
                    self.pending.popleft()
                    self.skipped.append(f"step {engine.step_no}: ExecutorLost: no executor")
                continue
            self._apply(engine, self.pending.popleft())

    def apply_next(self, engine: Engine) -> None:
        """Apply the inputs of the next recorded step now: the engine cannot reach that step.
        A loss it cannot reach is dropped (a what-if run that ended sooner)."""
        step = _step_of(self.pending[0])
        while self.pending and _step_of(self.pending[0]) == step:
            if isinstance(self.pending[0], ExecutorLost):
                self.skipped.append(f"step {engine.step_no}: ExecutorLost: never reached")
                self.pending.popleft()
                continue
            self.shifted += 1
            self._apply(engine, self.pending.popleft())

    def _apply(self, engine: Engine, rec: object) -> None:
        try:
            if isinstance(rec, RequestAdded):
                ids = list(rec.prompt_token_ids)
                engine.add_request(ids, rec.params, rec.request_id, rec.arrival_time)
            elif isinstance(rec, RequestAborted):
                engine.abort(rec.request_id)
            elif isinstance(rec, RequestResumed):
                ids, out = list(rec.prompt_token_ids), list(rec.output_token_ids)
                engine.resume_request(rec.request_id, ids, rec.params, out, rec.arrival_time)
            elif isinstance(rec, RequestNamed):
                return  # the client's name for a request: nothing for the engine
            elif isinstance(rec, SpecThresholdChanged):
                gaps = [list(g) for g in rec.probe_gaps]
                engine.set_spec_threshold(rec.threshold, list(rec.rates), gaps)
            else:
                raise TypeError(f"not an input record: {type(rec).__name__}")
        except (InvalidRequest, UnknownRequest) as exc:
            name = f"{type(rec).__name__} {getattr(rec, 'request_id', '?')}"
            self.skipped.append(f"step {engine.step_no}: {name}: {exc}")
            self.refused += 1


class _ScriptedLosses:
    """Starts the replay's executors, each wrapped to raise the recorded losses where they
    happened; the planted kills of the recorded config are left out (their losses are recorded).

    `pending` is the feeder's queue of inputs: a loss is taken off it when it is raised.
    """

    def __init__(self, pending: deque[object], factory: Callable):
        self.pending, self.factory = pending, factory

    def start(self, cfg: EngineConfig, max_model_len: int) -> _Scripted:
        self.raise_due("start", None)
        quiet = cfg.replace(
            debug_kill_executor_at=(),
            debug_kill_restarted_executor=False,
            host_leak_tolerance_mib=UNWATCHED_MIB,
        )
        return _Scripted(self, self.factory(quiet, max_model_len))

    def raise_due(self, during: str, step: int | None) -> None:
        """Raise the next recorded loss if it happened `during` this (at `step`, if given)."""
        head = self.pending[0] if self.pending else None
        if not isinstance(head, ExecutorLost) or head.during != during:
            return
        if step is not None and head.step != step:
            return
        self.pending.popleft()
        raise ExecutorDown(head.reason, give_up=head.gave_up)


class _Scripted:
    """One replay executor: the real one, unless the recording lost it here."""

    def __init__(self, script: _ScriptedLosses, executor):
        self.script, self.executor = script, executor

    def enter_phase(self, phase: str, step: int) -> PhaseReply:
        self.script.raise_due(phase, step)
        return self.executor.enter_phase(phase, step)

    def execute(self, plan: StepPlan) -> StepResult:
        self.script.raise_due("step", plan.step)
        return self.executor.execute(plan)

    def check(self) -> None:
        self.script.raise_due("idle", None)

    def close(self) -> None:
        self.executor.close()


def _step_of(rec: object) -> int:
    step = getattr(rec, "step", None)
    assert isinstance(step, int), f"{type(rec).__name__} has no step"
    return step
