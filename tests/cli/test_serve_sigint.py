"""Ctrl-C on `memstep serve`: the terminal sends SIGINT to its whole process group (the core,
its executor, the standby executor, the HTTP front); the core stops the others, and no process
prints a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from memstep.cli.serve import ServerProcess

TINY = ["--model", "random:tiny", "--num-threads", "1", "--standby-executor", "on"]


def tracebacks(text: str) -> list[str]:
    """The lines of `text` that say a Python process died of an exception."""
    said = ("Traceback", "KeyboardInterrupt")
    return [line for line in text.splitlines() if any(word in line for word in said)]


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()  # noqa: SIM115
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def test_ctrl_c_on_serve_stops_every_process_without_a_traceback():
    with ServerProcess(TINY, http=True, group=True) as server:
        server.wait_ready()
        pgid = server.proc.pid
        assert len(group_members(pgid)) >= 3  # the core, its executor, the HTTP front
        os.killpg(pgid, signal.SIGINT)
        assert server.proc.wait(timeout=60) == 0, server.log()
        deadline = time.monotonic() + 15
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        log = server.log()
        assert group_members(pgid) == [] and tracebacks(log) == [], log


def test_the_traceback_check_sees_a_process_that_dies_of_sigint():
    """The check above can fail: a Python process that does not ignore SIGINT, in a group that
    gets Ctrl-C, prints a KeyboardInterrupt traceback.  (Python's own handler is set in the
    child: one started by a process that ignores SIGINT, as a test worker may be, inherits that.)"""
    code = "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
    child = subprocess.Popen(
        [sys.executable, "-c", code + "print('up', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        process_group=0,
    )
    assert child.stdout is not None and child.stdout.readline() == "up\n"
    os.killpg(child.pid, signal.SIGINT)
    out, _ = child.communicate(timeout=10)
    assert tracebacks(out) != []
