"""Test-only planted executor deaths, as the config asks (`debug_kill_executor_at`,
`debug_kill_restarted_executor`), so that recovery tests kill the executor at a known step.

The process executor SIGKILLs itself, a real death the core must notice; the in-process one
raises `ExecutorDown` instead, since a SIGKILL would take the engine with it.
"""

from __future__ import annotations

from memstep.core.config import EngineConfig
from memstep.events.plan import PhaseRequest, StepPlan


def planted_death(cfg: EngineConfig, msg: object) -> str | None:
    """Why the executor must die instead of handling `msg`, or None."""
    if isinstance(msg, StepPlan) and msg.step in cfg.debug_kill_executor_at:
        return f"planted kill at step {msg.step}"
    restart_kill = cfg.debug_kill_restarted_executor
    if restart_kill and isinstance(msg, PhaseRequest) and msg.phase == "warmup":
        return "planted kill of a restarted executor in warmup"
    return None
