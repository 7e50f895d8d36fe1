"""A warm standby executor: a second executor process, model loaded, that a recovery adopts.

Starting an executor process is most of a recovery on the CPU: measured with SmolLM2-135M
(fp32, one thread, 2 shared cores), spawning it and loading the model took 10.7-14.4 s (torch
import 3.3 s, GGUF read and dequantized 7.6 s), while profile, warm-up and capture took 1.7 s.
`StandbyExecutors` is an executor factory that keeps one more process started and loaded
(spawned and handshaken from a thread of its own, `delay_s` after each executor it hands out,
so that loading it does not slow that one's start-up); when the engine asks for a new executor
it adopts the standby instead (`ProcessExecutor.adopt`) and starts the next standby.  Profile,
warm-up and capture still run on the adopted executor, through the engine's usual stages, so the
event log records the same phases as with a fresh process.

The price is memory: a standby holds a second copy of the weights (its resident bytes are in
StatsReply's `host_rss_bytes["standby"]`).  On the CPU that is host memory, cheap beside a
recovery ten seconds shorter; on a GPU it would be a second model copy in device memory that the
KV cache could have had, so `serve` starts a standby only on the CPU unless asked
(`--standby-executor`).  A standby that died, or whose start failed, is replaced by a fresh start:
correct, only slower.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from memstep.core.config import EngineConfig
from memstep.core.recovery import ExecutorDown
from memstep.executors.process.remote import ProcessExecutor

log = structlog.get_logger("memstep.executor.standby")

Factory = Callable[[EngineConfig, int], ProcessExecutor]


class _Launch(threading.Thread):
    """One standby: started `delay_s` from now in this thread, unless cancelled before."""

    def __init__(self, factory: Factory, cfg: EngineConfig, max_model_len: int, delay_s: float):
        super().__init__(name="standby-executor", daemon=True)
        self.factory, self.cfg, self.max_model_len = factory, cfg, max_model_len
        self.delay_s = delay_s
        self.cancelled = threading.Event()
        self.spawning = threading.Event()
        self.executor: ProcessExecutor | None = None
        self.start()

    def run(self) -> None:
        if self.cancelled.wait(self.delay_s):
            return
        self.spawning.set()
        try:
            self.executor = self.factory(self.cfg, self.max_model_len)
        except Exception as exc:  # ExecutorDown, OSError: the next recovery starts afresh
            log.warning("standby executor failed to start", error=str(exc))

    def take(self) -> ProcessExecutor | None:
        """The standby, once loaded; None if it was not spawned yet (cancelled) or failed."""
        self.cancelled.set()
        if self.spawning.is_set():
            self.join()  # loading already: sooner than a fresh start
        return self.executor


class StandbyExecutors:
    """An executor factory that adopts a loaded standby when it has one; owns the standby."""

    def __init__(self, factory: Factory, delay_s: float = 2.0):
        self.factory = factory
        self.delay_s = delay_s
        self._launch: _Launch | None = None
        self.num_adopted = 0

    def __call__(self, cfg: EngineConfig, max_model_len: int) -> ProcessExecutor:
        executor = self._adopt(cfg, max_model_len)
        if executor is None:
            executor = self.factory(cfg, max_model_len)
        self._launch = _Launch(self.factory, cfg, max_model_len, self.delay_s)
        return executor

    @property
    def standby_pid(self) -> int:
        """The loaded standby's process id; 0 while there is none."""
        launch = self._launch
        executor = launch.executor if launch is not None else None
        return executor.pid if executor is not None else 0

    def close(self) -> None:
        """Stop the standby.  One still loading is left to exit by itself when this process
        ends (an executor exits when its parent does)."""
        launch, self._launch = self._launch, None
        if launch is None:
            return
        launch.cancelled.set()
        launch.join(timeout=1.0)
        if launch.executor is not None:
            launch.executor.close()

    def _adopt(self, cfg: EngineConfig, max_model_len: int) -> ProcessExecutor | None:
        launch, self._launch = self._launch, None
        executor = launch.take() if launch is not None else None
        if executor is None:
            return None
        try:
            executor.adopt(cfg, max_model_len)
        except ExecutorDown as exc:
            log.warning("standby executor not adopted", reason=str(exc))
            executor.close()
            return None
        self.num_adopted += 1
        log.info("standby executor adopted", pid=executor.pid)
        return executor
