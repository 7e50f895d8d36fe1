"""The executor in the engine's own process: the same worker as the process executor, minus the
socket and the codec.  Used by tests, replay, `generate` and the offline benchmarks.

Records pass by reference, so neither side may keep and mutate what the other holds: plans are
built fresh by the core each step, and the worker copies what it keeps (`RequestStates`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.events.plan import PhaseReply, StepPlan, StepResult
from memstep.executors.worker import Worker


class InProcessExecutor:
    def __init__(self, cfg: EngineConfig, max_model_len: int):
        self.worker = Worker(cfg, max_model_len)

    def enter_phase(self, phase: str, step: int) -> PhaseReply:
        return self.worker.enter_phase(phase, step)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.worker.execute(plan)

    def close(self) -> None:
        pass


def local_engine(cfg: EngineConfig, sinks: Iterable[Callable[[object], None]] = ()) -> Engine:
    """An engine whose executor runs in this process."""
    return Engine(cfg, InProcessExecutor, sinks)
