"""Frames read while the executor runs a step: their prompts tokenized then, handled in order at
the next turn with those ids, and a prompt that fails ahead fails in its turn with its error."""

from __future__ import annotations

import time

import pytest
import zmq

from memstep.core.config import EngineConfig
from memstep.events import codec
from memstep.events.types import RequestAdded
from memstep.events.wire import ErrorReply, GenerateDone, GenerateRequest
from memstep.executors.process.inprocess import local_engine

PARAMS = {"max_tokens": 3, "ignore_eos": True, "seed": 1, "temperature": 0.0}


@pytest.fixture
def served(turned_server):
    with turned_server(local_engine(EngineConfig(model="random:tiny", num_threads=1))) as pair:
        yield pair


def _arrived(s: zmq.Socket, server, n: int) -> None:
    """Wait until `n` frames wait in the server's socket (sent, not yet read)."""
    for _ in range(200):
        if server.sock.poll(0):
            time.sleep(0.05)  # the rest of the burst
            return
        time.sleep(0.01)
    raise AssertionError("nothing arrived")


def test_frames_read_during_a_step_are_tokenized_then_and_handled_in_order(served):
    server, s = served
    added: list[RequestAdded] = []
    server.engine.sinks.append(lambda e: added.append(e) if isinstance(e, RequestAdded) else None)
    text, chat = "Tokenized while the executor runs.", [{"role": "user", "content": "Hi there"}]
    msgs = [
        GenerateRequest("a", prompt=text, params=PARAMS),
        GenerateRequest("b", prompt="", params=PARAMS),  # fails: an empty prompt
        GenerateRequest("c", messages=chat, params=PARAMS),
        GenerateRequest("d", prompt_token_ids=[5, 6, 7], params=PARAMS),
    ]
    for msg in msgs:
        s.send(codec.encode(msg))
    _arrived(s, server, len(msgs))
    server._read_ahead()  # as `_step` does between launch and finish
    assert [ahead and ahead[1] for _, ahead in server.early] == [
        server.engine.tokenizer.encode(text),
        [],  # the empty prompt's ids: refused in its turn, as without reading ahead
        server.engine.tokenizer.encode_chat(chat),
        None,  # ids given: nothing to make
    ]
    assert [ahead and ahead[0].request_id for _, ahead in server.early] == ["a", "b", "c", None]
    assert not added, "read ahead, nothing may enter the engine before the step ends"
    replies: list[object] = []
    for _ in range(200):
        server.run_once()
        while s.poll(0):
            replies.append(codec.decode(s.recv()))
        if sum(isinstance(r, GenerateDone | ErrorReply) for r in replies) == len(msgs):
            break
    assert not server.early
    assert [e.prompt_token_ids for e in added] == [
        server.engine.tokenizer.encode(text),
        server.engine.tokenizer.encode_chat(chat),
        [5, 6, 7],
    ]
    (error,) = [r for r in replies if isinstance(r, ErrorReply)]
    assert (error.request_id, error.code) == ("b", "invalid_request"), error
    assert "empty" in error.message
    done = {r.request_id for r in replies if isinstance(r, GenerateDone)}
    assert done == {"a", "c", "d"}


def test_a_frame_read_ahead_is_not_handled_twice_nor_lost(served):
    """Broken on purpose, the check fires: frames read ahead then dropped are never answered;
    handled again they are duplicates."""
    server, s = served
    s.send(codec.encode(GenerateRequest("x", prompt="once", params=PARAMS)))
    _arrived(s, server, 1)
    server._read_ahead()
    assert len(server.early) == 1
    kept = list(server.early)
    server.early.clear()  # lost: nothing answers x
    for _ in range(20):
        server.run_once()
    assert not s.poll(100)
    server.early.extend(kept + kept)  # twice: the second is refused as a duplicate in flight
    replies: list[object] = []
    for _ in range(200):
        server.run_once()
        while s.poll(0):
            replies.append(codec.decode(s.recv()))
        if any(isinstance(r, GenerateDone) for r in replies):
            break
    codes = [r.code for r in replies if isinstance(r, ErrorReply)]
    assert codes == ["duplicate_request"], replies
