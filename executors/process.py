"""The executor process: `python -m memstep.executors.process --endpoint ipc://...`.

It connects two DEALER sockets to the core's ROUTER: `main` carries the requests and replies
(ExecutorInit, PhaseRequest, StepPlan, ExecutorStop -> ExecutorReady, PhaseReply, StepResult,
ExecutorError), and `heartbeat`, driven by its own thread, sends a Heartbeat every interval and
watches the core's.  The process exits when the core's heartbeats stop or its parent dies, so an
executor is never orphaned.  The model and every tensor live here; the worker is imported only
after the core sent ExecutorInit.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback
from typing import Any

import structlog
import zmq

from memstep import __version__
from memstep.core.logging import setup_logging
from memstep.events import codec
from memstep.events.plan import PhaseRequest, StepPlan
from memstep.events.wire import (
    PROTOCOL_VERSION,
    ExecutorError,
    ExecutorHello,
    ExecutorInit,
    ExecutorReady,
    ExecutorStop,
    Heartbeat,
)

log = structlog.get_logger("memstep.executor.process")

MAIN_ID = b"main"
HEARTBEAT_ID = b"heartbeat"


class HeartbeatThread(threading.Thread):
    """Sends the executor's heartbeats and ends the process when the core goes quiet."""

    def __init__(self, ctx: zmq.Context, endpoint: str, interval: float, timeout: float):
        super().__init__(name="executor-heartbeat", daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, HEARTBEAT_ID)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.interval = interval
        self.timeout = timeout
        self.parent_pid = os.getppid()

    def run(self) -> None:
        last_core = time.monotonic()
        for seq in range(1 << 62):
            self.sock.send(codec.encode(Heartbeat("executor", seq, time.time())))
            while self.sock.poll(0):
                self.sock.recv()
                last_core = time.monotonic()
            if os.getppid() != self.parent_pid:
                _exit("the core process is gone")
            if time.monotonic() - last_core > self.timeout:
                _exit(f"no heartbeat from the core for {self.timeout:.1f} s")
            time.sleep(self.interval)


def _exit(why: str) -> None:
    log.error("executor exiting", reason=why)
    os._exit(3)


class ExecutorProcess:
    """Answers the core's messages on the main socket, one at a time, until ExecutorStop."""

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.worker: Any = None

    def serve(self) -> None:
        self.sock.send(codec.encode(ExecutorHello(os.getpid(), __version__, PROTOCOL_VERSION)))
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
        if isinstance(msg, PhaseRequest):
            return self.worker.enter_phase(msg.phase, msg.step)
        if isinstance(msg, StepPlan):
            return self.worker.execute(msg)
        raise NotImplementedError(f"the executor does not handle {type(msg).__name__}")

    def _init(self, msg: ExecutorInit) -> ExecutorReady:
        from memstep.core.config import EngineConfig
        from memstep.executors.worker import Worker

        self.worker = Worker(EngineConfig.from_dict(msg.config), msg.max_model_len)
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
    p.add_argument("--heartbeat-interval", type=float, default=0.2)
    p.add_argument("--core-timeout", type=float, default=10.0, help="exit after this silence")
    p.add_argument("--log-format", choices=["console", "json"], default="console")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    ctx = zmq.Context()
    HeartbeatThread(ctx, args.endpoint, args.heartbeat_interval, args.core_timeout).start()
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
