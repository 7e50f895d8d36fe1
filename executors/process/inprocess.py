"""The executor in the engine's own process: the same worker as the process executor, minus the
socket and the codec.  Used by tests, replay, `generate` and the offline benchmarks.

Records pass by reference, so neither side may keep and mutate what the other holds: plans are
built fresh by the core each step, and the worker copies what it keeps (`RunningRequests`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from memstep.core.config import ConfigError, EngineConfig
from memstep.core.engine import Engine
from memstep.core.executor import ExecutorFactory
from memstep.core.recovery import ExecutorDown
from memstep.events.plan import PhaseReply, PhaseRequest, StepPlan, StepResult
from memstep.executors.process.assemble import build_worker
from memstep.executors.process.faults import planted_death
from memstep.executors.process.remote import ProcessExecutor
from memstep.executors.runtime.worker import Worker


class InProcessExecutor:
    def __init__(self, cfg: EngineConfig, max_model_len: int):
        if cfg.tensor_parallel_size > 1:
            raise ConfigError("tensor-parallel ranks are processes: use the process executor")
        self.cfg = cfg
        self.worker: Worker | None = build_worker(cfg, max_model_len)

    def enter_phase(self, phase: str, step: int) -> PhaseReply:
        return self._worker(PhaseRequest(phase, step)).enter_phase(phase, step)

    def execute(self, plan: StepPlan) -> StepResult:
        return self._worker(plan).execute(plan)

    def close(self) -> None:
        self.worker = None  # its tensors go with it, before a new worker measures memory

    def _worker(self, msg: object) -> Worker:
        planted = planted_death(self.cfg, msg)
        if planted is not None:
            self.close()
            raise ExecutorDown(planted)
        if self.worker is None:
            raise ExecutorDown("the in-process executor was closed")
        return self.worker


def local_engine(cfg: EngineConfig, sinks: Iterable[Callable[[object], None]] = ()) -> Engine:
    """An engine whose executor runs in this process; under tensor parallelism its ranks are
    processes (`ProcessExecutor`) whatever the caller's choice."""
    factory: ExecutorFactory = InProcessExecutor
    if cfg.tensor_parallel_size > 1:
        factory = ProcessExecutor
    return Engine(cfg, factory, sinks)


def release_device_cache() -> None:
    """Give the CUDA allocator's cached blocks back to the device (nothing where CUDA was never
    used): after an engine is closed, what it freed is still reserved by the allocator until
    then. cuBLAS's workspaces too (32 MiB a stream on a Hopper card): torch keeps one for each
    stream that ran a matmul, allocated and never freed, so each engine's streams left theirs
    behind (measured: docs/benchmarks.md, "Figures behind the code's constants")."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
