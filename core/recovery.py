"""What the engine core knows about losing its executor and starting a new one.

The core holds every unfinished request's prompt, sampling parameters (with its seed) and every
token already sent, so a new executor can recompute the lost KV cache and go on: sampling is
keyed by (seed, position), so the completions are those of a run without the loss.  This module
owns the errors executors raise, the restart budget, and the stages of one recovery.
"""

from __future__ import annotations

import collections
import time

import attrs

from memstep.core.config import EngineConfig

# the stages of starting an executor, one per engine step while recovering, so that the server
# answers its clients (health: recovering) between them
START_STAGES = ("start", "profile", "warmup", "capture")


class ExecutorDown(RuntimeError):
    """The executor can no longer run plans: it died, went silent, or answered with an error.

    Executors raise subclasses of it; `give_up` is set only by a replay, which takes the
    recorded decision instead of the restart budget's (that one depends on wall time).
    """

    code = "executor_dead"

    def __init__(self, reason: str, give_up: bool | None = None):
        super().__init__(reason)
        self.give_up = give_up


class EngineDead(RuntimeError):
    """The executor died more often than the restart budget allows; every request failed."""

    code = "executor_dead"


class RestartBudget:
    """At most `limit` executor restarts within any `window_s` seconds (crash-loop protection)."""

    def __init__(self, limit: int, window_s: float):
        self.limit, self.window_s = limit, window_s
        self._times: collections.deque[float] = collections.deque()

    def take(self, now: float) -> bool:
        """Count a restart at `now`; False when it is one too many."""
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.limit:
            return False
        self._times.append(now)
        return True


@attrs.define
class Recovery:
    """One recovery in progress: which start stage is next, and what it re-admitted."""

    started: float  # time.monotonic() at the loss
    num_readmitted: int
    tokens_to_recompute: int
    kills_from: int  # planted kills (test-only) are given to new executors from this step on
    stage: int = 0  # index into START_STAGES
    num_starts: int = 0

    @property
    def next_stage(self) -> str:
        return START_STAGES[self.stage]

    def restart(self) -> None:
        """A start died: begin again with a new executor."""
        self.stage = 0

    def seconds(self) -> float:
        return time.monotonic() - self.started


def executor_config(cfg: EngineConfig, from_step: int, restarted: bool) -> EngineConfig:
    """The config a new executor gets: the planted kills from `from_step` on (one that fired is
    not planted again), and the planted crash loop only for a restarted executor.  The engine's
    own config never changes."""
    kills = tuple(s for s in cfg.debug_kill_executor_at if s >= from_step)
    loop = cfg.debug_kill_restarted_executor and restarted
    return cfg.replace(debug_kill_executor_at=kills, debug_kill_restarted_executor=loop)


def without_faults(cfg: EngineConfig) -> EngineConfig:
    """`cfg` with no planted executor deaths: what a standby executor must have been loaded with."""
    return cfg.replace(debug_kill_executor_at=(), debug_kill_restarted_executor=False)
