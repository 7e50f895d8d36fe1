"""The executor process: `python -m memstep.executors.process --endpoint ipc://...`.

A DEALER socket (routing id `main`) connected to the core's ROUTER carries the requests and
replies (ExecutorInit, PhaseRequest, StepPlan, ExecutorStop -> ExecutorReady, PhaseReply,
StepResult, ExecutorError).  A PAIR socket of its own, driven by a thread, carries heartbeats
both ways; the process exits when the core's heartbeats stop or its parent dies, so an executor
is never orphaned.  The model and every tensor live here; the worker is imported only
after the core sent ExecutorInit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import zmq

from memstep.core.logging import setup_logging
from memstep.events import codec
from memstep.events.plan import PhaseRequest, StepPlan
from memstep.events.version import VERSION
from memstep.events.wire import (
    PROTOCOL_VERSION,
    ExecutorError,
    ExecutorHello,
    ExecutorInit,
    ExecutorReady,
    ExecutorStop,
    Heartbeat,
)
from memstep.executors.faults import planted_death

log = structlog.get_logger("memstep.executor.process")

MAIN_ID = b"main"


class HeartbeatThread(threading.Thread):
    """Heartbeats on a PAIR socket of their own, sent every `interval` from this thread.

    Both ends run one: the core binds, the executor connects.  `silent_for()` says how long
    the peer has been quiet; `watchdog`, if given, is called after every beat (the executor
    uses it to exit when its core is gone).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        sender: str,
        interval: float,
        bind: bool,
        watchdog: Callable[[HeartbeatThread], None] | None = None,
    ):
        super().__init__(name=f"{sender}-heartbeat", daemon=True)
        self.sender, self.interval, self.watchdog = sender, interval, watchdog
        self.last_heard = time.monotonic()
        self.stopped = threading.Event()
        self.sock = ctx.socket(zmq.PAIR)  # used only by this thread once it has started
        self.sock.setsockopt(zmq.LINGER, 0)
        if bind:
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)

    def run(self) -> None:
        sock = self.sock
        seq = 0
        while not self.stopped.wait(self.interval):
            with contextlib.suppress(zmq.Again):  # no peer yet: the watchdog decides
                sock.send(codec.encode(Heartbeat(self.sender, seq, time.time())), zmq.NOBLOCK)
            seq += 1
            while sock.poll(0):
                sock.recv()
                self.last_heard = time.monotonic()
            if self.watchdog is not None:
                self.watchdog(self)
        sock.close(0)

    def silent_for(self) -> float:
        return time.monotonic() - self.last_heard

    def stop(self) -> None:
        self.stopped.set()
        self.join()


def core_watchdog(timeout: float, socket_dir: Path | None) -> Callable[[HeartbeatThread], None]:
    """End the executor when its parent (the core) dies or stops beating for `timeout` s.

    A core that died cannot remove its socket dir; the executor does it on the way out.
    """
    parent = os.getppid()

    def watch(beat: HeartbeatThread) -> None:
        if os.getppid() != parent:
            if socket_dir is not None:
                shutil.rmtree(socket_dir, ignore_errors=True)
            _exit("the core process is gone")
        if beat.silent_for() > timeout:
            _exit(f"no heartbeat from the core for {timeout:.1f} s")

    return watch


def _exit(why: str) -> None:
    log.error("executor exiting", reason=why)
    os._exit(3)


class ExecutorProcess:
    """Answers the core's messages on the main socket, one at a time, until ExecutorStop."""

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.worker: Any = None
        self.faults: Any = None  # the config whose test-only planted deaths apply

    def serve(self) -> None:
        self.sock.send(codec.encode(ExecutorHello(os.getpid(), VERSION, PROTOCOL_VERSION)))
        while True:
            frame = self.sock.recv()
            try:
                msg = codec.decode(frame)
            except codec.CodecError as exc:
                self._reply(ExecutorError("bad_message", str(exc)))
                continue
            if isinstance(msg, ExecutorStop):
                log.info("executor stopping", reason=msg.reason)
                return
            try:
                reply = self.handle(msg)
            except Exception as exc:
                log.exception("executor failed", message=type(msg).__name__)
                reply = ExecutorError("exception", _describe(exc))
            self._reply(reply)

    def handle(self, msg: object) -> object:
        if isinstance(msg, ExecutorInit):
            return self._init(msg)
        if self.worker is None:
            return ExecutorError("bad_message", f"{type(msg).__name__} before ExecutorInit")
        planted = planted_death(self.faults, msg)
        if planted is not None:
            log.error("executor killing itself", reason=planted)
            os.kill(os.getpid(), signal.SIGKILL)
        if isinstance(msg, PhaseRequest):
            return self.worker.enter_phase(msg.phase, msg.step)
        if isinstance(msg, StepPlan):
            return self.worker.execute(msg)
        raise NotImplementedError(f"the executor does not handle {type(msg).__name__}")

    def _init(self, msg: ExecutorInit) -> ExecutorReady | ExecutorError:
        """Load the model; or, for a standby executor loaded already (executors/standby.py),
        take the planted deaths of its new config: nothing else may differ."""
        from memstep.core.config import EngineConfig
        from memstep.core.recovery import without_faults
        from memstep.executors.worker import Worker

        cfg = EngineConfig.from_dict(msg.config)
        if self.worker is None:
            self.worker = Worker(cfg, msg.max_model_len)
        elif (without_faults(cfg), msg.max_model_len) != (
            without_faults(self.worker.cfg),
            self.worker.max_model_len,
        ):
            return ExecutorError("bad_message", "loaded already, with another config")
        self.faults = cfg
        return ExecutorReady(os.getpid(), str(self.worker.device))

    def _reply(self, rec: object) -> None:
        self.sock.send(codec.encode(rec))


def _describe(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1:]
    place = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
    return f"{type(exc).__name__}: {exc}{place}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memstep.executors.process")
    p.add_argument("--endpoint", required=True, help="the core's ROUTER, e.g. ipc:///tmp/x.sock")
    p.add_argument("--heartbeat-endpoint", required=True, help="the core's heartbeat PAIR")
    p.add_argument("--heartbeat-interval", type=float, default=0.2)
    p.add_argument("--core-timeout", type=float, default=10.0, help="exit after this silence")
    p.add_argument("--log-format", choices=["console", "json"], default="console")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    ctx = zmq.Context()
    ipc = args.endpoint.removeprefix("ipc://")
    watchdog = core_watchdog(args.core_timeout, Path(ipc).parent if ipc != args.endpoint else None)
    beat = HeartbeatThread(
        ctx,
        args.heartbeat_endpoint,
        "executor",
        args.heartbeat_interval,
        bind=False,
        watchdog=watchdog,
    )
    beat.start()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, MAIN_ID)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(args.endpoint)
    ExecutorProcess(sock).serve()
    sock.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a clean exit would wait on the heartbeat thread's zmq context
