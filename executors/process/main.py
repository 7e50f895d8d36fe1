"""The executor process: `python -m memstep.executors.process --endpoint ipc://...`.

A DEALER socket (routing id `main`) connected to the core's ROUTER carries the requests and
replies (ExecutorInit, PhaseRequest, StepPlan, ExecutorStop -> ExecutorReady, PhaseReply,
StepResult, ExecutorError).  A PAIR socket of its own, driven by a thread, carries heartbeats
both ways; the process exits when the core's heartbeats stop or its parent dies, so an executor
is never orphaned.  The model and every tensor live here; the worker is imported only
after the core sent ExecutorInit.

Tensor parallelism (`--tensor-parallel-size N`): this process is one of N ranks in a
torch.distributed group (`rank_group.py`).  Rank 0 alone speaks to the core, as above; it
broadcasts each message it receives to the other ranks and gathers their replies into its own
(`rank_replies.py`).  A broadcast rather than a fan-out from the core: the core keeps one peer,
one socket and one reply per message whatever N is; the ranks receive the very bytes rank 0
acts on, in the order it acts on them, over the group they must share anyway (and, on another
machine, without a second connection to the core).  The price, per message: two small gloo
broadcasts out and two all-gathers back (each ~0.3-0.5 ms over loopback on the crowded 2-core
machine of docs/tensor_parallel.md; tens of microseconds on an idle host).  Ranks 1..N-1
(`follow`) exit when their parent dies, or when a collective fails because a peer did.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import zmq

from memstep.core.logging import setup_logging
from memstep.events import codec
from memstep.events.plan import EXECUTOR_PROTOCOL_VERSION, PhaseRequest, StepPlan
from memstep.events.version import VERSION
from memstep.events.wire import (
    ExecutorError,
    ExecutorHello,
    ExecutorInit,
    ExecutorReady,
    ExecutorStop,
    Heartbeat,
)
from memstep.executors.process.faults import planted_death
from memstep.executors.process.rank_replies import merge_replies

if TYPE_CHECKING:  # imports torch: the core imports this module and must not load it
    from memstep.executors.model.rank_group import RankGroup

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
    """Exit now, whatever becomes of the line that says why: a stderr whose reader is gone
    (EPIPE) must not leave an orphan holding the model."""
    try:
        log.error("executor exiting", reason=why)
    except BaseException:
        pass
    finally:
        os._exit(3)


def watch_parent(interval: float = 0.2) -> None:
    """For ranks 1..N-1, which have no heartbeat of their own: end when the parent (the core,
    or `memstep executor`) is gone, from a thread, since the main one may wait in a collective."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        _exit("the parent process is gone")

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class ExecutorProcess:
    """Answers the core's messages on the main socket, one at a time, until ExecutorStop; as
    rank 0 of a tensor-parallel group (`ranks`), with every rank doing the same."""

    def __init__(self, sock: zmq.Socket | None, ranks: RankGroup | None = None):
        self.sock = sock
        self.ranks = ranks
        self.worker: Any = None
        self.faults: Any = None  # the config whose test-only planted deaths apply

    def serve(self) -> None:
        assert self.sock is not None
        self.sock.send(codec.encode(ExecutorHello(os.getpid(), VERSION, EXECUTOR_PROTOCOL_VERSION)))
        while True:
            frame = self.sock.recv()
            try:
                msg = codec.decode(frame)
            except codec.CodecError as exc:
                self._reply(ExecutorError("bad_message", str(exc)))
                continue
            if self.ranks is not None:
                self.ranks.broadcast_frame(frame)
            if isinstance(msg, ExecutorStop):
                log.info("executor stopping", reason=msg.reason)
                return
            reply = self.answer(msg)
            if self.ranks is not None:
                others = self.ranks.gather_frames(codec.encode(reply))[1:]
                reply = merge_replies([reply, *(codec.decode(f) for f in others)])
            self._reply(reply)

    def follow(self) -> None:
        """Ranks 1..N-1: answer what rank 0 broadcasts, until ExecutorStop."""
        assert self.ranks is not None
        while True:
            msg = codec.decode(self.ranks.broadcast_frame(None))
            if isinstance(msg, ExecutorStop):
                return
            self.ranks.gather_frames(codec.encode(self.answer(msg)))

    def answer(self, msg: object) -> object:
        try:
            return self.handle(msg)
        except Exception as exc:
            log.exception("executor failed", message=type(msg).__name__)
            return ExecutorError("exception", _describe(exc))

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
        """Load the model; or, for a standby executor loaded already (executors/process/standby.py),
        take the planted deaths of its new config: nothing else may differ."""
        from memstep.core.config import EngineConfig
        from memstep.core.recovery import without_faults
        from memstep.executors.process.assemble import build_worker

        cfg = EngineConfig.from_dict(msg.config)
        if self.worker is None:
            self.worker = build_worker(cfg, msg.max_model_len, self.ranks)
        elif (without_faults(cfg), msg.max_model_len) != (
            without_faults(self.worker.cfg),
            self.worker.max_model_len,
        ):
            return ExecutorError("bad_message", "loaded already, with another config")
        self.faults = cfg
        return ExecutorReady(os.getpid(), str(self.worker.device))

    def _reply(self, rec: object) -> None:
        assert self.sock is not None
        self.sock.send(codec.encode(rec))


def _describe(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1:]
    place = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
    return f"{type(exc).__name__}: {exc}{place}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memstep.executors.process")
    p.add_argument("--endpoint", help="the core's ROUTER, e.g. ipc:///tmp/x.sock (rank 0)")
    p.add_argument("--heartbeat-endpoint", help="the core's heartbeat PAIR (rank 0)")
    p.add_argument("--heartbeat-interval", type=float, default=0.2)
    p.add_argument("--core-timeout", type=float, default=10.0, help="exit after this silence")
    p.add_argument("--rank", type=int, default=0, help="this process's tensor-parallel rank")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--distributed-init-method", help="tcp://HOST:PORT where the ranks meet")
    p.add_argument("--log-format", choices=["console", "json"], default="console")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    if args.rank > 0:
        return _follower(args)
    if args.endpoint is None or args.heartbeat_endpoint is None:
        p.error("rank 0 needs --endpoint and --heartbeat-endpoint")
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
    ranks = _join(args) if args.tensor_parallel_size > 1 else None
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, MAIN_ID)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(args.endpoint)
    ExecutorProcess(sock, ranks).serve()
    sock.close()
    return 0


def _join(args: argparse.Namespace) -> RankGroup:
    if args.distributed_init_method is None:
        raise SystemExit("tensor parallelism needs --distributed-init-method tcp://HOST:PORT")
    from memstep.executors.model.rank_group import RankGroup

    log.info("joining", rank=args.rank, size=args.tensor_parallel_size)
    return RankGroup(args.rank, args.tensor_parallel_size, args.distributed_init_method)


def _follower(args: argparse.Namespace) -> int:
    """Rank R > 0: no socket to the core; rank 0 relays every message."""
    watch_parent()
    ExecutorProcess(None, _join(args)).follow()
    return 0
