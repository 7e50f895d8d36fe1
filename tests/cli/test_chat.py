"""`memstep chat`: answers stream, turns are kept, /reset forgets them; in a real terminal (pty)."""

from __future__ import annotations

import io
import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest

from memstep.cli.chat import Session
from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import RequestAdded
from memstep.executors.process.inprocess import local_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class Writes(io.StringIO):
    """A terminal stand-in that keeps each write apart."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return super().write(text)


@pytest.fixture(scope="module")
def engine():
    engine = local_engine(EngineConfig(model="random:tiny", num_threads=1, max_num_seqs=1))
    yield engine
    engine.shutdown()


def _prompts(engine, session: Session, lines: str) -> list[int]:
    """The prompt length of each request the session sent for `lines`."""
    seen: list[int] = []

    def note(rec: object) -> None:
        if isinstance(rec, RequestAdded):
            seen.append(len(rec.prompt_token_ids))

    engine.sinks.append(note)
    try:
        session.run(io.StringIO(lines), Writes())
    finally:
        engine.sinks.pop()
    return seen


def test_answers_stream_token_by_token(engine):
    out = Writes()
    Session(engine, GREEDY, None).run(io.StringIO("hello\n"), out)
    answer = out.parts[out.parts.index("> ") + 1 : out.parts.index("\n")]
    assert len(answer) == GREEDY.max_tokens  # one write per token, not one at the end


def test_turns_are_kept_until_reset(engine):
    session = Session(engine, GREEDY, "be brief")
    lengths = _prompts(engine, session, "hello\nagain\n/reset\nhello\n")
    first, second, after_reset = lengths
    assert second > first + GREEDY.max_tokens  # the first turn and its answer were sent again
    assert after_reset == first  # /reset: only the system message is left
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]


def test_a_turn_beyond_the_context_is_refused_and_the_session_goes_on(engine):
    out = Writes()
    session = Session(engine, GREEDY, None)
    session.run(io.StringIO("x" * (engine.max_model_len + 10) + "\nhi\n"), out)
    assert "(not sent: prompt has" in out.getvalue()
    assert [m["role"] for m in session.messages] == ["user", "assistant"]


def _read_until(fd: int, marker: bytes, timeout: float = 60.0) -> bytes:
    got = b""
    deadline = time.monotonic() + timeout
    while marker not in got:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no {marker!r} in {got!r}"
        got += os.read(fd, 4096)
    return got


def test_chat_in_a_terminal():
    """The real command on a pty: a banner, two turns, /reset, then Ctrl-D ends it (exit 0)."""
    main, child = pty.openpty()
    cmd = [sys.executable, "-m", "memstep.cli.main", "--log-level", "warning", "chat"]
    cmd += ["--model", "random:tiny", "--num-threads", "1", "--greedy", "--max-tokens", "4"]
    proc = subprocess.Popen(cmd, stdin=child, stdout=child, stderr=child, close_fds=True)
    os.close(child)
    try:
        assert b"/reset forgets" in _read_until(main, b"> ")
        for line, marker in [(b"hello", b"> "), (b"again", b"> "), (b"/reset", b"forgotten")]:
            os.write(main, line + b"\n")
            _read_until(main, marker)
        os.write(main, b"\x04")  # Ctrl-D
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main)


class CtrlC(Writes):
    """A terminal whose user presses Ctrl-C (a real SIGINT to this process) once the first
    answer's third token is written."""

    def __init__(self) -> None:
        super().__init__()
        self.num_tokens = 0

    def write(self, text: str) -> int:
        if text not in ("> ", "\n") and not text.startswith("("):
            self.num_tokens += 1
            if self.num_tokens == 3:
                os.kill(os.getpid(), signal.SIGINT)
        return super().write(text)


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(engine):
    """Ctrl-C ends the answer between two steps (the request aborted in the engine) and the
    next line is answered; without the handler the SIGINT would be a KeyboardInterrupt that
    ends the program, and this test with it."""
    out = CtrlC()
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    session = Session(engine, long, None)
    before = signal.getsignal(signal.SIGINT)  # a test worker may have been started ignoring it
    session.run(io.StringIO("hello\nagain\n"), out)
    assert out.getvalue().count("(stopped)\n") == 1
    assert out.num_tokens == 3 + 40  # the stopped answer's 3, then the next answer whole
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2
    assert not engine.has_work() and signal.getsignal(signal.SIGINT) is before  # handed back
