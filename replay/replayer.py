"""Deterministic replay: rebuild the recorded engine and feed it the recorded inputs.

The engine's step counter advances only when a step runs, so each input is applied right before
the step whose number it was recorded at, exactly as it arrived in the recorded run.  Scheduling
depends only on step numbers and sampling only on (seed, position), so an unchanged engine emits
the recorded derived records again, byte for byte.

A what-if run (config overrides) may finish requests sooner or later than the recording did.  When
it goes idle before the next input's step, that input is applied at once (counted in
`inputs_shifted`); an input that no longer applies (aborting a request that already finished, a
request the new config refuses) is skipped with the reason.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import attrs

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine, UnknownRequest
from memstep.core.sampling_params import InvalidRequest, SamplingParams
from memstep.events.types import EngineStarted, RequestAborted, RequestAdded, is_input
from memstep.executors.inprocess import InProcessExecutor
from memstep.replay.recording import Recording


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

    @property
    def derived(self) -> list[object]:
        return [r for r in self.records if not is_input(r)]


def replay(
    recording: Recording,
    overrides: dict[str, Any] | None = None,
    executor_factory: Callable = InProcessExecutor,
) -> ReplayRun:
    """Replay `recording` through a fresh engine built from its header's config (+ `overrides`).

    A damaged or unfinished log is replayed up to the last step it recorded (a what-if run goes
    on until its inputs are served); a corrupt one only up to its first gap, since a lost record
    may have been an input.  The engine is shut down when the recorded one was; otherwise its
    shutdown records are not collected.
    """
    recording = recording.before_damage()
    cfg = EngineConfig.from_dict({**recording.config, **(overrides or {})})
    records: list[object] = []
    engine = Engine(cfg, executor_factory, sinks=[records.append])
    feeder = _Feeder(recording.inputs)
    stop = None if recording.is_complete or overrides else recording.last_step
    try:
        _run(engine, feeder, stop)
        if not recording.was_shut_down:
            engine.sinks.clear()
    finally:
        engine.shutdown()
    started = records[0]
    assert isinstance(started, EngineStarted)
    return ReplayRun(cfg, started.model_identity, records, feeder.skipped, feeder.shifted, stop)


def _run(engine: Engine, feeder: _Feeder, stop: int | None) -> None:
    while True:
        feeder.apply_due(engine)
        if stop is not None and engine.step_no > stop:
            return
        if engine.has_work():
            before = engine.step_no
            engine.step()
            if engine.step_no > before:
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

    def apply_due(self, engine: Engine) -> None:
        """Apply every input recorded at (or, after a divergence, before) this step."""
        while self.pending and _step_of(self.pending[0]) <= engine.step_no:
            self._apply(engine, self.pending.popleft())

    def apply_next(self, engine: Engine) -> None:
        """Apply the inputs of the next recorded step now: the engine cannot reach that step."""
        step = _step_of(self.pending[0])
        while self.pending and _step_of(self.pending[0]) == step:
            self.shifted += 1
            self._apply(engine, self.pending.popleft())

    def _apply(self, engine: Engine, rec: object) -> None:
        try:
            if isinstance(rec, RequestAdded):
                params = SamplingParams.from_dict(rec.params)
                ids = list(rec.prompt_token_ids)
                engine.add_request(ids, params, rec.request_id, rec.arrival_time)
            elif isinstance(rec, RequestAborted):
                engine.abort(rec.request_id)
            else:
                raise TypeError(f"not an input record: {type(rec).__name__}")
        except (InvalidRequest, UnknownRequest) as exc:
            name = f"{type(rec).__name__} {getattr(rec, 'request_id', '?')}"
            self.skipped.append(f"step {engine.step_no}: {name}: {exc}")


def _step_of(rec: object) -> int:
    step = getattr(rec, "step", None)
    assert isinstance(step, int), f"{type(rec).__name__} has no step"
    return step
