"""The server admits a constrained request once a worker has checked its constraint, and steps
the others meanwhile: with the check worker stopped, a plain request runs to its end while the
constrained one waits; past MAX_CHECKING waiting checks a request is refused `overloaded`; a
check that fails is the request's `invalid_request`."""

from __future__ import annotations

import os
import signal
import time

import pytest
import zmq

from memstep.core.config import EngineConfig
from memstep.core.grammar import ConstraintBook
from memstep.core.grammar_check import GrammarChecker
from memstep.events import codec
from memstep.events.wire import AbortRequest, ErrorReply, GenerateDone, GenerateRequest
from memstep.executors.process.inprocess import local_engine
from memstep.serving import core_admission

PARAMS = {"max_tokens": 3, "ignore_eos": True, "seed": 1, "temperature": 0.0}


@pytest.fixture
def served(turned_server):
    with turned_server(local_engine(EngineConfig(model="random:tiny", num_threads=1))) as pair:
        book = ConstraintBook()  # its own worker, which the tests stop
        book._checker = GrammarChecker(num_workers=1)
        pair[0].grammars = book
        yield pair
        pair[0].grammars.close()


def _replies(server, s: zmq.Socket, wanted: set[str], turns: int = 400) -> dict[str, object]:
    """Turn the server until each request in `wanted` has its final reply."""
    final: dict[str, object] = {}
    for _ in range(turns):
        server.run_once()
        while s.poll(0):
            msg = codec.decode(s.recv())
            if isinstance(msg, (GenerateDone, ErrorReply)):
                final[msg.request_id] = msg
        if wanted <= set(final):
            return final
        time.sleep(0.005)
    raise AssertionError(f"no final reply for {wanted - set(final)}")


def _stop_the_worker(server) -> None:
    """The book's one worker, warm, then stopped (SIGSTOP): it answers nothing."""
    assert server.grammars.error("regex", "warm") == ""
    (pid,) = server.grammars.checker.pids()
    os.kill(pid, signal.SIGSTOP)


def test_a_plain_request_runs_to_its_end_while_a_constraint_waits_for_its_check(served):
    server, s = served
    _stop_the_worker(server)
    s.send(codec.encode(GenerateRequest("c", prompt="Hi", params={**PARAMS, "guided_regex": "a+"})))
    s.send(codec.encode(GenerateRequest("p", prompt="Hi", params=PARAMS)))
    final = _replies(server, s, {"p"})
    assert isinstance(final["p"], GenerateDone) and "c" not in final
    assert [c.msg.request_id for c in server.checking] == ["c"]
    for pid in server.grammars.checker.pids():
        os.kill(pid, signal.SIGCONT)
    final = _replies(server, s, {"c"})
    assert isinstance(final["c"], GenerateDone) and server.checking == []


def test_past_the_waiting_checks_a_request_is_overloaded(served, monkeypatch):
    server, s = served
    monkeypatch.setattr(core_admission, "MAX_CHECKING", 2)
    _stop_the_worker(server)
    for i in range(3):
        params = {**PARAMS, "guided_regex": f"b{{{i + 1}}}"}
        s.send(codec.encode(GenerateRequest(f"r{i}", prompt="Hi", params=params)))
    final = _replies(server, s, {"r2"})
    assert isinstance(final["r2"], ErrorReply) and final["r2"].code == "overloaded"
    assert len(server.checking) == 2


def test_a_constraint_that_does_not_compile_is_refused_after_its_check(served):
    server, s = served
    params = {**PARAMS, "guided_regex": "(unclosed"}
    s.send(codec.encode(GenerateRequest("u", prompt="Hi", params=params)))
    reply = _replies(server, s, {"u"})["u"]
    assert isinstance(reply, ErrorReply) and reply.code == "invalid_request"
    assert "unclosed" in reply.message and server.grammars.num_refused == 1


def test_a_request_aborted_while_its_check_runs_ends_with_abort(served):
    server, s = served
    _stop_the_worker(server)
    s.send(codec.encode(GenerateRequest("c", prompt="Hi", params={**PARAMS, "guided_regex": "z+"})))
    for _ in range(20):
        server.run_once()
    assert [c.msg.request_id for c in server.checking] == ["c"]
    s.send(codec.encode(AbortRequest("a", "c")))
    final = _replies(server, s, {"c"})
    assert isinstance(final["c"], GenerateDone) and final["c"].finish_reason == "abort"
    assert server.checking == [] and server.engine.requests == {}
