"""Grammar checks in worker processes: a crash, a stack overflow or a stall of the grammar
engine costs the request that brought it its 400, never the process that asked.

`GrammarChecker` keeps up to `num_workers` child processes, each running `check_worker`:
it reads (kind, text) and answers core/grammar.py's `compile_error` of it.  A check is a
`Check`; `poll` settles the checks whose answers came, whose worker died (the request is refused
with what happened) or whose time ran past `budget_s` (the worker is killed, the request
refused); a fresh worker takes the dead one's place at the next check.  Nothing is pickled
on the pipes: a check and its answer travel as JSON and UTF-8 text.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import IO

import attrs

DEFAULT_WORKERS = 2
DEFAULT_BUDGET_S = 10.0  # a check past this is refused, its worker killed
START_BUDGET_S = 120.0  # a worker's start (its tokenizer built) past this: killed


@attrs.define(eq=False)
class Check:
    """One constraint's check: `error` is None until it is settled, then "" (it compiles) or
    why not."""

    kind: str
    text: str
    error: str | None = None
    started: float = 0.0
    lasting: bool = True  # False: its verdict depends on the machine's load (a timeout)

    @property
    def is_done(self) -> bool:
        return self.error is not None


class _Worker:
    """A check process (core/grammar_worker.py) and the check it runs."""

    def __init__(self, args: list[str]) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [os.path.dirname(root), env.get("PYTHONPATH")])
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "memstep.core.grammar_worker", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: a frame read leaves the next in the pipe, where select sees it
            env=env,
        )
        self.check: Check | None = None
        self.ready = False  # its first frame says it is (its tokenizer built)
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()

    def send(self, kind: str, text: str) -> None:
        assert self.proc.stdin is not None
        _write(self.proc.stdin, json.dumps([kind, text]).encode())

    def answer(self) -> str | None:
        """The answer the process wrote, or None where it died instead."""
        assert self.proc.stdout is not None
        data = _read(self.proc.stdout)
        return None if data is None else data.decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class GrammarChecker:
    """A bounded pool of check processes, driven by its owner's loop (`poll`) or waited on
    (`wait`); no thread of its own."""

    def __init__(
        self,
        num_workers: int = DEFAULT_WORKERS,
        budget_s: float = DEFAULT_BUDGET_S,
        args: list[str] | None = None,
    ):
        self.num_workers = num_workers
        self.budget_s = budget_s
        self.args = args or []  # the workers' command line (the model's tokenizer)
        self.idle: list[_Worker] = []
        self.busy: list[_Worker] = []
        self.queued: deque[Check] = deque()
        self.num_crashed = 0
        self.num_timed_out = 0

    def submit(self, kind: str, text: str) -> Check:
        check = Check(kind, text)
        self.queued.append(check)
        self._start_queued()
        return check

    def poll(self, timeout: float = 0.0) -> None:
        """Settle what is ready (waiting up to `timeout` s for something to be), and start
        the queued checks on the free workers."""
        if self.busy:
            pipes = {w.fd: w for w in self.busy}
            ready, _, _ = select.select(list(pipes), [], [], timeout)
            for fd in ready:
                self._settle(pipes[fd])
            now = time.monotonic()
            for worker in list(self.busy):
                assert worker.check is not None
                limit = self.budget_s if worker.ready else START_BUDGET_S
                if now - worker.check.started > limit:
                    self.num_timed_out += 1
                    assert worker.check is not None
                    worker.check.lasting = False
                    self._drop(worker, f"took longer than the {self.budget_s:g} s compile budget")
        self._start_queued()

    def wait(self, check: Check) -> str:
        """Block until `check` is settled; its error ("" where the constraint compiles)."""
        while check.error is None:
            self.poll(0.05)
        return check.error

    def close(self) -> None:
        for worker in self.idle + self.busy:
            worker.stop()
        self.idle, self.busy = [], []

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.idle + self.busy]

    def _start_queued(self) -> None:
        while self.queued and (self.idle or len(self.busy) < self.num_workers):
            worker = self.idle.pop() if self.idle else _Worker(self.args)
            check = self.queued.popleft()
            try:
                worker.send(check.kind, check.text)
            except OSError:  # it died idle: a fresh one takes the check
                worker.stop()
                self.queued.appendleft(check)
                continue
            check.started = time.monotonic()
            worker.check = check
            self.busy.append(worker)

    def _settle(self, worker: _Worker) -> None:
        answer = worker.answer()
        if answer is not None and not worker.ready:  # its tokenizer built: the check begins
            assert worker.check is not None
            worker.ready, worker.check.started = True, time.monotonic()
            return
        if answer is not None:
            assert worker.check is not None
            worker.check.error, worker.check = answer, None
            self.busy.remove(worker)
            self.idle.append(worker)
            return
        self.num_crashed += 1
        code = worker.proc.wait(5)
        self._drop(worker, f"crashed the grammar engine (exit code {code})")

    def _drop(self, worker: _Worker, why: str) -> None:
        assert worker.check is not None
        worker.check.error = f"the constraint {why}"
        worker.check = None
        self.busy.remove(worker)
        worker.stop()


def _write(pipe: IO[bytes], data: bytes) -> None:
    pipe.write(len(data).to_bytes(4, "little") + data)
    pipe.flush()


def _read(pipe: IO[bytes]) -> bytes | None:
    """One frame, or None at the end of the pipe (reads may come short: the parent's side is
    unbuffered)."""
    head = _read_exactly(pipe, 4)
    if head is None:
        return None
    return _read_exactly(pipe, int.from_bytes(head, "little"))


def _read_exactly(pipe: IO[bytes], size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        chunk = pipe.read(size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def check_worker(stdin: IO[bytes], stdout: IO[bytes], check: Callable[[str, str], str]) -> None:
    """A check process's loop (core/grammar_worker.py): say it is ready (an empty frame), then
    answer each (kind, text) with `check`'s verdict, until stdin closes."""
    _write(stdout, b"")
    while (data := _read(stdin)) is not None:
        kind, text = json.loads(data)
        _write(stdout, check(kind, text).encode())
