"""What the engine core asks of an executor: the seam between deciding and running.

Four implementations stand behind it: the process executor (executors/process/remote.py), the
in-process one (executors/process/inprocess.py), replay's scripted one (replay/replayer.py) and
the tests' wrappers. The core imports none of them; the caller picks one (`ExecutorFactory`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from memstep.core.config import EngineConfig
from memstep.events.plan import PhaseReply, StepPlan, StepResult


@runtime_checkable
class Executor(Protocol):
    """Runs what the core decided: phase changes and step plans, each answered with a reply.
    Raises `recovery.ExecutorDown` when it is gone."""

    def enter_phase(self, phase: str, step: int) -> PhaseReply: ...

    def execute(self, plan: StepPlan) -> StepResult: ...

    def close(self) -> None: ...


@runtime_checkable
class Submits(Protocol):
    """Optional: `execute` in two halves, so that the core works while the executor runs."""

    def submit(self, plan: StepPlan) -> None: ...

    def collect(self) -> StepResult: ...

    def ready(self, timeout: float) -> bool:
        """Whether `collect` would return (or raise) at once, waiting up to `timeout` s."""
        ...


@runtime_checkable
class Checked(Protocol):
    """Optional: an executor whose death the core can learn of between steps, without a call
    (`check` raises ExecutorDown; never blocks)."""

    def check(self) -> None: ...


@runtime_checkable
class OwnProcess(Protocol):
    """Optional: an executor in a process of its own, whose host memory is not the core's."""

    @property
    def pid(self) -> int: ...


ExecutorFactory = Callable[[EngineConfig, int], Executor]  # (config, max model length)

REQUIRED = ("enter_phase", "execute", "close")


def require_executor(candidate: object) -> Executor:
    """`candidate`, if it has every method an executor must have; else TypeError naming the
    first one missing (a factory that returns the wrong object fails at start, not mid-step)."""
    for name in REQUIRED:
        if not callable(getattr(candidate, name, None)):
            raise TypeError(f"{type(candidate).__name__} is not an executor: it has no {name}()")
    assert isinstance(candidate, Executor)
    return candidate
