"""A local replica's tie to its router: when the router's process dies, the replica ends too.

The router starts each local replica with `PARENT_ENV` set to its own pid (`replica_env`).  The
replica (`memstep serve`, `follow_parent`) then asks Linux for SIGTERM when its parent dies
(prctl PR_SET_PDEATHSIG: a router killed with SIGKILL still sends it) and, on any system, watches
its parent's pid from a thread: once the router is gone it sends itself SIGTERM, so it stops as
on Ctrl-C (its log closed, its executor stopped), and exits outright if that takes longer than
`GRACE_S`.  Its executor already ends with its own parent (`executors/process/main.py`), so no
process of a replica outlives the router: none holds a port or a GPU after a crash.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

PARENT_ENV = "MEMSTEP_ROUTER_PID"  # set by the router in each local replica's environment
PR_SET_PDEATHSIG = 1  # linux/prctl.h
GRACE_S = 5.0  # after the SIGTERM, the replica exits outright this much later
WATCH_INTERVAL_S = 0.2


def replica_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with this process named as the replica's parent, whose death ends it."""
    return {**env, PARENT_ENV: str(os.getpid())}


def follow_parent() -> None:
    """In a replica the router started: end this process when the router's does.  Nothing when
    `PARENT_ENV` is unset (a replica started by hand); the variable is taken out of the
    environment so the replica's own children (its executor) do not read it."""
    given = os.environ.pop(PARENT_ENV, None)
    if given is None:
        return
    parent = int(given)
    if sys.platform.startswith("linux"):
        _death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # the router died before the tie was made
        _leave("the router was gone at start")
    threading.Thread(target=_watch, args=(parent,), name="router-watch", daemon=True).start()


def _death_signal(sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    _leave("the router's process is gone")


def _leave(why: str) -> None:
    """SIGTERM to this process (a graceful stop); `os._exit` if it is still here after GRACE_S."""
    with contextlib.suppress(OSError):  # a stderr whose reader is gone must not stop the exit
        print(f"memstep serve: stopping: {why}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os._exit(3)
