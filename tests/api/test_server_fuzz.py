"""Fuzz the API socket: random and mutated frames each get an answer; the server never dies."""

from __future__ import annotations

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memstep.api.client import Client
from memstep.cli.serve import ServerProcess
from memstep.events import codec
from memstep.events.wire import (
    AbortReply,
    ErrorReply,
    GenerateDelta,
    GenerateDone,
    HealthReply,
    Keepalive,
    StatsReply,
)

NUM_FRAMES = 2000
TIMEOUT_MS = 20_000
TINY_SERVER = ["--model", "random:tiny", "--num-threads", "1"]
FINAL = (ErrorReply, GenerateDone, HealthReply, StatsReply, AbortReply)
ERROR_CODES = {
    "malformed_frame",
    "frame_too_large",
    "unknown_type",
    "missing_field",
    "invalid_field",
    "unknown_field",
    "invalid_request",
    "unknown_request",
    "duplicate_request",
}

SEEDS = [
    {"t": "HealthRequest", "request_id": "h"},
    {"t": "StatsRequest", "request_id": "s"},
    {"t": "AbortRequest", "request_id": "a", "target_id": "g"},
    {"t": "GenerateRequest", "request_id": "g", "prompt": "fuzz", "params": {"max_tokens": 3}},
    {
        "t": "GenerateRequest",
        "request_id": "g",
        "prompt_token_ids": [5, 6, 7],
        "params": {"max_tokens": 2, "temperature": 0.7, "top_p": 0.9, "seed": 3},
        "stream": True,
    },
    {
        "t": "GenerateRequest",
        "request_id": "g",
        "messages": [{"role": "user", "content": "hi"}],
        "params": {"max_tokens": 2, "top_k": 5, "stop": ["x"]},
    },
]
KEYS = sorted({k for seed in SEEDS for k in seed} | {"max_tokens", "top_p", "temperature"})

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.sampled_from(["GenerateRequest", "HealthRequest", "AbortRequest", "g", "h"]),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=12,
)


@st.composite
def mutated_map(draw) -> bytes:
    obj = dict(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(KEYS))
        action = draw(st.sampled_from(["set", "delete", "params"]))
        if action == "delete":
            obj.pop(key, None)
        elif action == "set":
            obj[key] = draw(values)
        else:
            params = obj.get("params")
            params = dict(params) if isinstance(params, dict) else {}
            params[draw(st.sampled_from(KEYS))] = draw(values)
            obj["params"] = params
    return msgpack.packb(obj, use_bin_type=True)


@st.composite
def mutated_bytes(draw) -> bytes:
    data = bytearray(msgpack.packb(draw(st.sampled_from(SEEDS))))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip":
            data[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[i:]
            if not data:
                break
        else:
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


frames = st.one_of(
    st.binary(max_size=64),
    values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    mutated_map(),
    mutated_bytes(),
)


@pytest.fixture(scope="module")
def server():
    with ServerProcess(TINY_SERVER) as proc:
        proc.wait_ready()
        yield proc


def answer(sock: zmq.Socket, frame: bytes) -> object:
    """Send one frame; read replies until the one that ends it, and return that one."""
    sock.send(frame)
    while True:
        assert sock.poll(TIMEOUT_MS), f"no reply to {frame!r}"
        reply = codec.decode(sock.recv())
        if isinstance(reply, FINAL):
            return reply
        assert isinstance(reply, GenerateDelta | Keepalive), reply


def test_fuzzed_frames_all_get_answers_and_the_server_survives(server):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    sent: list[bytes] = []
    codes: dict[str, int] = {}

    @settings(
        max_examples=NUM_FRAMES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(frame=frames)
    def one_frame(frame: bytes) -> None:
        sent.append(frame)
        reply = answer(sock, frame)
        if isinstance(reply, ErrorReply):
            assert reply.code in ERROR_CODES, reply
            codes[reply.code] = codes.get(reply.code, 0) + 1

    one_frame()
    assert not sock.poll(300), "a frame got more than one final reply"
    sock.close(0)
    assert len(sent) >= NUM_FRAMES
    assert len(codes) >= 6, f"the fuzz reached too few kinds of errors: {codes}"
    assert server.proc.poll() is None, "the server died"
    with Client(server.address, timeout=10) as client:
        assert client.health().status == "ok"
        done = client.generate("still here", max_tokens=4)
        assert len(done.token_ids) == 4
        assert client.stats().num_inflight == 0
