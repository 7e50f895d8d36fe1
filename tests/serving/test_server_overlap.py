"""The server sends a step's outputs while the executor, in its own process, runs the next step."""

from __future__ import annotations

import pytest
import zmq

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams
from memstep.events import codec
from memstep.events.wire import (
    AbortReply,
    AbortRequest,
    GenerateDelta,
    GenerateDone,
    GenerateRequest,
)
from memstep.executors.process.remote import ProcessExecutor
from memstep.serving.core_process import Server

TIMEOUT_MS = 10_000


@pytest.fixture(scope="module")
def served(turned_server):
    """A real Server on a real socket, turned by the test, in front of an executor process."""
    with turned_server(
        Engine(EngineConfig(model="random:tiny", num_threads=1), ProcessExecutor)
    ) as pair:
        yield pair


def replies(server: Server, s: zmq.Socket, until: type, turns: int = 500) -> list[object]:
    """Turn the server until a reply of type `until` arrives; every reply so far."""
    got: list[object] = []
    for _ in range(turns):
        server.run_once()
        while s.poll(0):
            got.append(codec.decode(s.recv()))
        if got and isinstance(got[-1], until):
            return got
    raise AssertionError(f"no {until.__name__} in {turns} turns: {got}")


def test_a_step_s_outputs_are_sent_while_the_executor_runs_the_next(served, monkeypatch):
    """Each streamed token leaves the server between the executor's hand-over of the next step
    and its result: with the outputs sent after the wait, as before, no send is in a step."""
    server, s = served
    executor = server.engine.executor
    events: list[str] = []
    for name in ("submit", "collect"):
        real = getattr(executor, name)
        monkeypatch.setattr(executor, name, _noting(events, name, real))
    monkeypatch.setattr(server, "_send", _noting(events, "send", server._send))
    params = {"max_tokens": 6, "ignore_eos": True}
    s.send(
        codec.encode(GenerateRequest("a", prompt_token_ids=[5, 6, 7], params=params, stream=True))
    )
    got = replies(server, s, GenerateDone)
    assert [type(r) for r in got] == [GenerateDelta] * 6 + [GenerateDone]
    assert sum(len(r.token_ids) for r in got[:-1]) == 6 == len(got[-1].token_ids)
    assert events.count("submit") == 6 and events.count("send") == 7
    sends_in_a_step = [_in_flight(events[:i]) for i, e in enumerate(events) if e == "send"]
    # the deltas of steps 0-4 went out during steps 1-5; the last step's delta and the done after
    assert sends_in_a_step == [True] * 5 + [False] * 2, events


def test_frames_that_come_while_the_executor_runs_are_read_ahead_until_its_result(
    served, monkeypatch
):
    """A prompt that arrives after the step's hand-over is tokenized before its result, not
    between that result and the next plan: read once just after the hand-over, as before, it
    waited for the next turn (broken on purpose, `early` stays empty after the turn)."""
    server, s = served
    executor = server.engine.executor
    text = "Came while the executor ran the step."
    late = GenerateRequest("late", prompt=text, params={"max_tokens": 2, "ignore_eos": True})
    real_ready, calls = executor.ready, []

    def ready(timeout: float) -> bool:
        calls.append(timeout)
        if len(calls) > 1:
            return real_ready(timeout)
        s.send(codec.encode(late))
        assert server.sock.poll(TIMEOUT_MS), "the late frame never came"
        return False  # the step still runs

    monkeypatch.setattr(executor, "ready", ready)
    params = {"max_tokens": 2, "ignore_eos": True}
    s.send(codec.encode(GenerateRequest("first", prompt_token_ids=[5, 6, 7], params=params)))
    assert s.poll(0) == 0 and server.sock.poll(TIMEOUT_MS)
    server.run_once()  # takes "first", launches its step; "late" comes while it runs
    assert len(calls) >= 2, calls
    assert [(a and a[0].request_id, a and a[1]) for _, a in server.early] == [
        ("late", server.engine.tokenizer.encode(text))
    ]
    got = replies(server, s, GenerateDone)
    while sum(isinstance(r, GenerateDone) for r in got) < 2:
        got += replies(server, s, GenerateDone)
    assert {r.request_id for r in got if isinstance(r, GenerateDone)} == {"first", "late"}


def _in_flight(before: list[str]) -> bool:
    """Whether a step was handed over and not yet collected at the end of `before`."""
    last = [e for e in before if e in ("submit", "collect")]
    return bool(last) and last[-1] == "submit"


def _noting(events: list[str], name: str, call):
    def noted(*args, **kwargs):
        events.append(name)
        return call(*args, **kwargs)

    return noted


def test_an_abort_of_a_request_whose_last_output_is_not_sent_yet_sends_that_output_first(served):
    """A request finished in the engine while its last output waits for the next turn: an abort
    arriving then delivers that output (the real completion, "length") before its AbortReply,
    not "unknown request" nor an "abort" missing the last token, and the server serves on."""
    server, s = served
    s.send(codec.encode(GenerateRequest("b", prompt_token_ids=[5, 6, 7], params={"max_tokens": 1})))
    for _ in range(500):
        server.run_once()
        if server.unsent:
            break
    assert [out.finished for out in server.unsent] == [True]
    s.send(codec.encode(AbortRequest("x", "b")))
    assert server.sock.poll(TIMEOUT_MS), "the abort did not reach the server"
    got = replies(server, s, AbortReply)
    assert len(got) == 2 and got[-1] == AbortReply("x", "b"), got
    assert isinstance(got[0], GenerateDone) and got[0].finish_reason == "length", got
    assert len(got[0].token_ids) == 1 and got[0].usage.completion_tokens == 1
    s.send(codec.encode(GenerateRequest("c", prompt_token_ids=[8, 9], params={"max_tokens": 2})))
    done = replies(server, s, GenerateDone)[-1]
    assert done.request_id == "c" and len(done.token_ids) == 2


def test_an_input_while_a_step_is_launched_is_refused(served):
    """Adds and aborts land between steps (a replay applies them before the next plan): the
    engine refuses one while a launched step runs, and finishes the step afterwards."""
    engine = served[0].engine
    rid = engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1))
    assert engine.launch()
    with pytest.raises(RuntimeError, match="launched"):
        engine.add_request([8, 9], SamplingParams(temperature=0.0, max_tokens=1))
    with pytest.raises(RuntimeError, match="launched"):
        engine.abort(rid)
    with pytest.raises(RuntimeError, match="launched"):
        engine.step()
    outputs = engine.finish()
    assert [(out.request_id, out.finished) for out in outputs] == [(rid, True)]


def test_a_request_finished_before_the_engine_gives_up_gets_its_completion(turned_server):
    """The executor dies past the restart budget while a finished request's last output waits:
    that output goes out before every request in flight is failed."""
    cfg = EngineConfig(model="random:tiny", num_threads=1, max_executor_restarts=0)
    with turned_server(Engine(cfg, ProcessExecutor)) as (server, s):
        s.send(
            codec.encode(GenerateRequest("d", prompt_token_ids=[5, 6], params={"max_tokens": 1}))
        )
        for _ in range(500):
            server.run_once()
            if server.unsent:
                break
        assert [out.finished for out in server.unsent] == [True]
        server.engine.executor.proc.kill()
        server.engine.executor.proc.wait()
        got = replies(server, s, GenerateDone, turns=50)
        assert server.executor_death is not None
        assert len(got) == 1 and got[0].finish_reason == "length", got
