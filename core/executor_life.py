"""The engine's executor, from start to shutdown: start-up stages, and what happens when it is
lost (the loss recorded, `recover` entered, every unfinished request requeued, a new executor
started one stage per engine step so that the engine's caller keeps answering clients, or the
engine given up past the restart budget).

`ExecutorLife` is a part of `Engine` (a base class), kept in its own file so that the engine
reads as its step; the attributes it uses are the engine's, declared here.
"""

from __future__ import annotations

import time

import attrs
import structlog

from memstep.core import request_log
from memstep.core.block_manager import BlockManager
from memstep.core.config import EngineConfig
from memstep.core.executor import Checked, Executor, ExecutorFactory, require_executor
from memstep.core.recovery import (
    START_STAGES,
    EngineDead,
    ExecutorDown,
    Recovery,
    RestartBudget,
    executor_config,
)
from memstep.core.request import Request
from memstep.core.scheduler import Scheduler
from memstep.events.plan import MemoryPlan, MemoryPlanned, PhaseFigures
from memstep.events.types import (
    ExecutorLost,
    PhaseChanged,
    RecoveryDone,
    RecoveryStarted,
    RequestPreempted,
)

log = structlog.get_logger("memstep.engine")


class ExecutorLife:
    """Starts the engine's executor, takes it through its phases, and recovers from its loss."""

    cfg: EngineConfig
    executor: Executor  # None once lost (`_close_executor`) until the next start
    executor_factory: ExecutorFactory
    max_model_len: int
    step_no: int
    state: str  # as the executor last reported it; the executor checks the table
    scheduler: Scheduler
    requests: dict[str, Request]
    restarts: RestartBudget
    recovery: Recovery | None
    death: str | None  # why the engine gave up on executors
    num_losses: int
    memory_plan: MemoryPlan
    rank_memory_plans: list[MemoryPlan]
    warmup_figures: PhaseFigures
    captured: PhaseFigures
    _aborted_in_recovery: list[str]

    def emit(self, rec: object) -> None:
        raise NotImplementedError  # the engine's

    def _finish(self, req: Request, reason: str) -> None:
        raise NotImplementedError  # the engine's

    @property
    def is_recovering(self) -> bool:
        return self.recovery is not None

    def _phase(self, phase: str):
        reply = self.executor.enter_phase(phase, self.step_no)
        self.emit(PhaseChanged(self.step_no, self.state, phase))
        log.info("phase", step=self.step_no, old=self.state, new=phase)
        self.state = phase
        for rec in [*reply.exited, *reply.entered, *reply.leaks]:
            self.emit(rec)
        return reply

    def _start_stage(self, stage: str) -> None:
        """Start an executor (`start`) or take it through one start-up phase."""
        if stage == "start":
            restarted = self.recovery is not None
            first = self.recovery.kills_from if self.recovery is not None else 0
            cfg = executor_config(self.cfg, first, restarted)
            self.executor = require_executor(self.executor_factory(cfg, self.max_model_len))
        elif stage == "profile":
            reply = self._phase("profile")
            if reply.memory_plan is None:
                raise RuntimeError("the executor's profile reply has no memory plan")
            self.memory_plan = reply.memory_plan
            self.rank_memory_plans = reply.rank_memory_plans
            self.emit(MemoryPlanned(self.step_no, reply.memory_plan))
        elif stage == "warmup":
            self.warmup_figures = self._phase("warmup").figures
        else:
            self.captured = self._phase(stage).figures

    def _pages(self) -> BlockManager:
        num_blocks, cfg = self.memory_plan.num_kv_blocks, self.cfg
        return BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)

    def _lookahead(self) -> int:
        return 1 if self.captured.decode_ahead else 0  # the executor replays ahead

    def check_executor(self) -> None:
        """Learn of a death between steps, from an executor that can tell without a call."""
        executor = self.executor
        if not isinstance(executor, Checked) or self.recovery is not None or self.death is not None:
            return
        try:
            executor.check()
        except ExecutorDown as exc:
            self._lose(exc, "idle")

    def _lose(self, exc: ExecutorDown, during: str) -> None:
        """Record the loss, then recover, or give up past the restart budget (EngineDead)."""
        reason = str(exc)
        self.num_losses += 1
        allowed = self.restarts.take(time.monotonic()) if exc.give_up is None else not exc.give_up
        self.emit(ExecutorLost(self.step_no, reason, during, not allowed))
        log.error("executor lost", step=self.step_no, during=during, reason=reason)
        self._close_executor()
        if not allowed:
            self._give_up(reason)
        if self.state != "recover":
            self.emit(PhaseChanged(self.step_no, self.state, "recover"))
            self.state = "recover"
        if self.recovery is not None:
            self.recovery.restart()
            return
        self._evicted(self.scheduler.running, "recovery", reason)
        readmitted, tokens = self.scheduler.requeue_all()
        num_waiting = len(self.scheduler.waiting)
        self.emit(RecoveryStarted(self.step_no, self.num_losses, readmitted, num_waiting, tokens))
        kills_from = self.step_no + 1 if during == "step" else self.step_no
        self.recovery = Recovery(time.monotonic(), readmitted, tokens, kills_from)

    def _evicted(self, reqs: list[Request], cause: str, why: str = "") -> None:
        """Record the requests sent back to the queue to recompute their KV (a preemption, or a
        requeue by an executor loss): the logs, `inspect` and `trace` read these records."""
        for req in reqs:
            rec = RequestPreempted(self.step_no, req.request_id, cause, req.num_tokens)
            self.emit(rec)
            request_log.evicted(rec, req, why)

    def _recover_stage(self) -> None:
        assert self.recovery is not None
        rec = self.recovery
        stage = rec.next_stage
        rec.num_starts += stage == "start"
        try:
            self._start_stage(stage)
        except ExecutorDown as exc:
            self._lose(exc, stage)
            return
        rec.stage += 1
        if rec.stage < len(START_STAGES):
            return
        self.scheduler.use_pages(self._pages(), self._lookahead())
        self.recovery = None
        done = RecoveryDone(
            self.step_no, rec.num_readmitted, rec.tokens_to_recompute, rec.num_starts, rec.seconds()
        )
        self.emit(done)
        log.warning("executor recovered", **attrs.asdict(done))
        aborted, self._aborted_in_recovery = self._aborted_in_recovery, []
        for request_id in aborted:
            self._finish(self.requests[request_id], "abort")

    def _close_executor(self) -> None:
        executor, self.executor = self.executor, None
        if executor is not None:
            executor.close()

    def _give_up(self, reason: str) -> None:
        """Fail every unfinished request and stay dead: a supervisor restarts the whole server."""
        self.death = reason
        self.recovery = None
        self._aborted_in_recovery.clear()
        for req in list(self.requests.values()):
            self._finish(req, "executor_dead")
        log.error("engine dead: too many executor restarts", reason=reason)
        raise EngineDead(f"executor lost too often (last: {reason})")

    def shutdown(self) -> None:
        if self.state == "shutdown":
            self._close_executor()
            return
        if self.executor is None:  # lost, and no new one started yet (or given up)
            self.emit(PhaseChanged(self.step_no, self.state, "shutdown"))
            self.state = "shutdown"
            return
        try:
            self._phase("shutdown")
        finally:
            self._close_executor()
