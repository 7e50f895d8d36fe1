"""The engine side of the executor socket: `ProcessExecutor`.

It spawns `python -m memstep.executors.process` and speaks to it over ZeroMQ ipc (a socket in a
private temp dir), with the same interface as `InProcessExecutor`:
``Engine(cfg, executor_factory=ProcessExecutor)``.  This module never imports torch or the
worker; the executor process loads the model.

Liveness: heartbeats go both ways on a PAIR socket of their own, each end sending from a thread,
so they flow while either side is busy.  The executor is dead once its process has exited
(checked at every `check()` and every 50 ms while waiting for a reply, so a SIGKILL is noticed
within ~50 ms) or once its heartbeats have stopped for `heartbeat_timeout` seconds (it is then
killed); until the model has loaded the limit is `start_timeout`, since importing torch can hold
the GIL, and so the heartbeat thread, for seconds.  An executor whose core stops beating exits
by itself.  After death every call raises `ExecutorDied`; the engine then starts a new executor
(core/recovery.py).

Tensor parallelism: rank 0 is the process above; the core also starts the other ranks of this
machine (`local_ranks.py`) and watches them with the same `check()`: any rank's death is the
executor's.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import tempfile
from typing import TypeVar

import structlog
import zmq

from memstep.core.config import EngineConfig
from memstep.core.recovery import ExecutorDown
from memstep.events import codec
from memstep.events.plan import (
    EXECUTOR_PROTOCOL_VERSION,
    PhaseReply,
    PhaseRequest,
    StepPlan,
    StepResult,
)
from memstep.events.wire import (
    ExecutorError,
    ExecutorHello,
    ExecutorInit,
    ExecutorReady,
    ExecutorStop,
)
from memstep.executors.cpu.threads import executor_env
from memstep.executors.process.local_ranks import (
    LocalRanks,
    how_it_ended,
    loopback_init_method,
    rank_arguments,
)
from memstep.executors.process.main import MAIN_ID, HeartbeatThread

log = structlog.get_logger("memstep.executor.remote")

POLL_S = 0.05

T = TypeVar("T")


class ExecutorDied(ExecutorDown):
    """The executor process is gone or unresponsive; the message says which and why."""

    code = "executor_dead"


class ExecutorFailed(ExecutorDown):
    """The executor answered with an error (or nonsense); it is still running."""

    code = "executor_error"


class ProcessExecutor:
    """Owns the executor process, its ROUTER socket, and the temp dir of the ipc endpoint."""

    def __init__(
        self,
        cfg: EngineConfig,
        max_model_len: int,
        *,
        heartbeat_interval: float = 0.2,
        heartbeat_timeout: float = 5.0,
        start_timeout: float = 120.0,
        log_level: str = "warning",
        log_format: str = "console",
    ):
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.start_timeout = start_timeout
        self.death: str | None = None
        self._dir = tempfile.mkdtemp(prefix="memstep-exec-")
        self.endpoint = f"ipc://{self._dir}/executor.sock"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._inbox: collections.deque[bytes] = collections.deque()
        self._beat = HeartbeatThread(
            self._ctx, f"ipc://{self._dir}/heartbeat.sock", "core", heartbeat_interval, bind=True
        )
        self._beat.start()
        self._ready = False
        self._closed = False
        init_method = cfg.distributed_init_method or loopback_init_method()
        ranks_args = rank_arguments(cfg, init_method)
        log_args = ["--log-level", log_level, "--log-format", log_format]
        self.proc = subprocess.Popen(
            self._command(heartbeat_timeout * 2, log_level, log_format) + ranks_args,
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno(),
            env=executor_env(os.environ),
        )
        self.ranks = LocalRanks(cfg, init_method, executor_env(os.environ), log_args)
        try:
            self._handshake(cfg, max_model_len)
        except BaseException:
            self.close()
            raise

    def _command(self, core_timeout: float, log_level: str, log_format: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "memstep.executors.process",
            "--endpoint",
            self.endpoint,
            "--heartbeat-endpoint",
            f"ipc://{self._dir}/heartbeat.sock",
            "--heartbeat-interval",
            str(self.heartbeat_interval),
            "--core-timeout",
            str(max(core_timeout, 10.0)),
            "--log-level",
            log_level,
            "--log-format",
            log_format,
        ]

    def _handshake(self, cfg: EngineConfig, max_model_len: int) -> None:
        hello = self._wait_for(ExecutorHello)
        if hello.protocol != EXECUTOR_PROTOCOL_VERSION:
            raise ExecutorFailed(
                f"executor speaks protocol {hello.protocol}, not {EXECUTOR_PROTOCOL_VERSION}"
            )
        ready = self._call(ExecutorInit(cfg.to_dict(), max_model_len), ExecutorReady)
        self._ready = True  # importing torch can hold the GIL, and so the heartbeats, for seconds
        log.info("executor ready", pid=ready.pid, device=ready.device, endpoint=self.endpoint)

    def adopt(self, cfg: EngineConfig, max_model_len: int) -> None:
        """Take a loaded standby executor into service with `cfg` (its planted deaths may differ
        from those it was loaded with; nothing else may)."""
        self._call(ExecutorInit(cfg.to_dict(), max_model_len), ExecutorReady)

    # --- the executor interface ------------------------------------------------------------

    def enter_phase(self, phase: str, step: int) -> PhaseReply:
        return self._call(PhaseRequest(phase, step), PhaseReply)

    def execute(self, plan: StepPlan) -> StepResult:
        return self._call(plan, StepResult)

    def submit(self, plan: StepPlan) -> None:
        """`execute` in two halves: send the plan; the executor runs it while this process does
        other work, until `collect` waits for the result."""
        self._post(plan)

    def collect(self) -> StepResult:
        return self._wait_for(StepResult)

    def ready(self, timeout: float) -> bool:
        """`Submits.ready`: the reply came within `timeout` s, or the executor is gone (which
        `collect` then raises)."""
        if not self._inbox:
            try:
                self.check()
                self._pump(timeout)
            except ExecutorDown:
                return True
        return bool(self._inbox)

    def close(self) -> None:
        """Ask the executor to stop, kill it if it does not, and remove the socket."""
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            self._send(MAIN_ID, ExecutorStop("close"))
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.ranks.wait(timeout=5)
        self._beat.stop()
        self._sock.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # --- liveness --------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def is_alive(self) -> bool:
        return self.death is None

    def check(self) -> None:
        """Raise ExecutorDied if the executor is gone.  Never blocks."""
        if self.death is not None:
            raise ExecutorDied(self.death)
        reason = self._why_dead()
        if reason is not None:
            self._die(reason)

    def _why_dead(self) -> str | None:
        others = self.ranks.why_dead()  # first: rank 0 exits when a peer's death broke the group
        code = self.proc.poll()
        if code is not None:
            first = f"executor process {self.proc.pid} died ({how_it_ended(code)})"
            return first if others is None else f"{others}; {first}"
        if others is not None:
            return others
        limit = self.heartbeat_timeout if self._ready else self.start_timeout
        if self._beat.silent_for() > limit:
            return f"executor process {self.proc.pid} sent no heartbeat for {limit:.1f} s"
        return None

    def _die(self, reason: str) -> None:
        self.death = reason
        log.error("executor dead", reason=reason)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.ranks.kill()
        raise ExecutorDied(reason)

    # --- messages --------------------------------------------------------------------------

    def _call(self, msg: object, expect: type[T]) -> T:
        self._post(msg)
        return self._wait_for(expect)

    def _post(self, msg: object) -> None:
        self.check()
        if self._inbox:
            raise ExecutorFailed(f"executor sent {len(self._inbox)} unrequested message(s)")
        self._send(MAIN_ID, msg)

    def _wait_for(self, expect: type[T]) -> T:
        while not self._inbox:
            self.check()
            self._pump(POLL_S)
        try:
            reply = codec.decode(self._inbox.popleft())
        except codec.CodecError as exc:
            raise ExecutorFailed(f"undecodable reply from the executor: {exc}") from exc
        if isinstance(reply, ExecutorError):
            raise ExecutorFailed(f"{reply.code}: {reply.message}")
        if not isinstance(reply, expect):
            raise ExecutorFailed(f"expected {expect.__name__}, got {type(reply).__name__}")
        return reply

    def _pump(self, timeout: float) -> None:
        """Queue the replies that arrive within `timeout`."""
        if not self._sock.poll(int(timeout * 1000)):
            return
        while self._sock.poll(0):
            frames = self._sock.recv_multipart()
            if frames[0] == MAIN_ID:
                self._inbox.append(frames[-1])

    def _send(self, to: bytes, msg: object) -> None:
        try:
            self._sock.send_multipart([to, codec.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # not connected (yet, or any more): liveness decides
            log.debug("executor send failed", to=to, error=str(exc))
