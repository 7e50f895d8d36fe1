"""Every kind of bad input gets its typed ErrorReply, and the server keeps serving."""

from __future__ import annotations

import math

import msgpack
import pytest
import zmq

from memstep.api.client import Client, ServerError
from memstep.cli.serve import ServerProcess
from memstep.core.config import EngineConfig
from memstep.events import codec
from memstep.events.wire import ErrorReply, HealthReply
from memstep.executors.process.inprocess import local_engine
from memstep.serving import core_admission
from memstep.serving.core_process import Server

TIMEOUT_MS = 10_000
TINY_SERVER = ["--model", "random:tiny", "--num-threads", "1"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(TINY_SERVER) as proc:  # context 512, vocab 512
        proc.wait_ready()
        yield proc


@pytest.fixture(scope="module")
def sock(server):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(server.address)
    yield s
    s.close(0)


def ask(sock: zmq.Socket, frame: bytes) -> object:
    sock.send(frame)
    assert sock.poll(TIMEOUT_MS), "no reply"
    return codec.decode(sock.recv())


def gen(**fields) -> bytes:
    return msgpack.packb({"t": "GenerateRequest", "request_id": "r1", **fields})


def nest(depth: int, leaf: object) -> object:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


CASES = [
    # wire level
    (b"\xc1", "malformed_frame", "not a msgpack message"),
    (b"\x92\x01", "malformed_frame", "not a msgpack message"),  # truncated array
    (msgpack.packb({"t": "HealthRequest", "request_id": "r1"}) + b"\x00", "malformed_frame", ""),
    (msgpack.packb([1, 2]), "malformed_frame", "expected a msgpack map"),
    (b"", "malformed_frame", "empty frame"),
    (msgpack.packb({"request_id": "r1"}), "unknown_type", "unknown message type None"),
    (msgpack.packb({"t": "Shutdown", "request_id": "r1"}), "unknown_type", "'Shutdown'"),
    (msgpack.packb({"t": "StepPlan", "request_id": "r1"}), "unknown_type", "'StepPlan'"),
    (msgpack.packb({"t": "GenerateRequest"}), "missing_field", "'request_id'"),
    (msgpack.packb({"t": "AbortRequest", "request_id": "r1"}), "missing_field", "'target_id'"),
    (gen(prompt=5), "invalid_field", "GenerateRequest.prompt"),
    (gen(prompt="hi", stream="yes"), "invalid_field", "GenerateRequest.stream"),
    (gen(prompt_token_ids=[1, "2"]), "invalid_field", "prompt_token_ids[1]"),
    (gen(prompt="hi", params=[1]), "invalid_field", "GenerateRequest.params"),
    (gen(prompt="hi", colour=1), "unknown_field", "'colour'"),
    (msgpack.packb({"t": "HealthRequest", "request_id": ""}), "invalid_field", "request_id"),
    (msgpack.packb({"t": "HealthRequest", "request_id": "x" * 129}), "invalid_field", "1 to 128"),
    # nesting, ext types and encodings: refused while decoding, before any field is looked at
    (b"\x81\xa1t" + b"\x91" * 1000 + b"\x01", "malformed_frame", "nested deeper than 32"),
    (b"\x81\xa1t" + b"\x91" * 100_000 + b"\x01", "malformed_frame", "nested deeper than 32"),
    (gen(prompt="hi", params={"stop": nest(31, "x")}), "malformed_frame", "nested deeper than 32"),
    (gen(prompt="hi", params={"stop": nest(30, "x")}), "invalid_request", "non-empty strings"),
    (msgpack.packb({"t": nest(6, "x"), "request_id": "r1"}), "unknown_type", "[[[[...]]]]"),
    (gen(prompt="hi", params={"seed": msgpack.ExtType(1, b"x")}), "malformed_frame", "ExtType"),
    (gen(prompt=msgpack.Timestamp(0, 0)), "malformed_frame", "Timestamp"),
    (b"\x82\xa1t\xadHealthRequest\xaarequest_id\xa2\xff\xfe", "malformed_frame", "utf-8"),
    (b"\x81\xa1t\xdb\xff\xff\xff\xf0", "malformed_frame", "not a msgpack message"),  # 4 GB str
    # prompt
    (gen(prompt_token_ids=[1, 512]), "invalid_request", "token id 512 is outside the vocabulary"),
    (gen(prompt_token_ids=[-1]), "invalid_request", "outside the vocabulary"),
    (gen(prompt=""), "invalid_request", "prompt is empty"),
    (gen(prompt_token_ids=[]), "invalid_request", "prompt is empty"),
    (gen(prompt_token_ids=[5] * 600), "invalid_request", "context is 512"),
    (gen(prompt="x", prompt_token_ids=[5]), "invalid_request", "exactly one of"),
    (gen(), "invalid_request", "exactly one of"),
    (gen(messages=[]), "invalid_request", "messages is empty"),
    (gen(messages=[{"role": "user"}]), "invalid_request", "'role' and 'content'"),
    # sampling params
    (gen(prompt="hi", params={"max_tokens": 0}), "invalid_request", "max_tokens must be >= 1"),
    (gen(prompt="hi", params={"max_tokens": -4}), "invalid_request", "max_tokens must be >= 1"),
    (gen(prompt="hi", params={"max_tokens": 600}), "invalid_request", "exceeds the context"),
    (gen(prompt="hi", params={"temperature": -0.5}), "invalid_request", "temperature must be >= 0"),
    (gen(prompt="hi", params={"temperature": math.nan}), "invalid_request", "finite"),
    (gen(prompt="hi", params={"top_p": 0.0}), "invalid_request", "top_p must be in (0, 1]"),
    (gen(prompt="hi", params={"top_p": 1.5}), "invalid_request", "top_p must be in (0, 1]"),
    (gen(prompt="hi", params={"max_tokens": "8"}), "invalid_request", "wrong type"),
    (gen(prompt="hi", params={"bogus": 1}), "invalid_request", "unknown sampling params"),
    (gen(prompt="hi", params={b"top_k": 1}), "invalid_request", "names must be strings"),
]


@pytest.mark.parametrize(
    ("frame", "code", "message"), CASES, ids=[f"{i}-{c[1]}" for i, c in enumerate(CASES)]
)
def test_bad_request_gets_its_typed_error(sock, frame, code, message):
    reply = ask(sock, frame)
    assert isinstance(reply, ErrorReply), reply
    echoed = "r1" if code != "malformed_frame" and b"r1" in frame else ""
    assert (reply.code, reply.request_id) == (code, echoed), reply
    assert message in reply.message


def test_abort_of_an_unknown_request(sock):
    reply = ask(sock, msgpack.packb({"t": "AbortRequest", "request_id": "a", "target_id": "zz"}))
    assert reply == ErrorReply("a", "unknown_request", "unknown request id 'zz'")


def test_abort_of_another_clients_request_is_unknown(server):
    with Client(server.address, timeout=10) as owner, Client(server.address, timeout=10) as other:
        stream = owner.generate(
            "mine", stream=True, max_tokens=400, ignore_eos=True, temperature=0.0
        )
        next(stream)
        with pytest.raises(ServerError) as err:
            other.abort(stream.request_id)
        assert err.value.code == "unknown_request"
        stream.close()
        assert stream.result is not None and stream.result.finish_reason == "abort"


def test_duplicate_request_id_in_flight(sock):
    first = gen(prompt="hi", params={"max_tokens": 300, "ignore_eos": True})
    sock.send(first)
    reply = ask(sock, first)
    assert isinstance(reply, ErrorReply) and reply.code == "duplicate_request", reply
    sock.send(msgpack.packb({"t": "AbortRequest", "request_id": "a", "target_id": "r1"}))
    kinds = set()
    while "AbortReply" not in kinds:
        assert sock.poll(TIMEOUT_MS)
        kinds.add(type(codec.decode(sock.recv())).__name__)
    assert "GenerateDone" in kinds


def test_frame_over_the_limit_gets_frame_too_large(sock):
    reply = ask(sock, gen(prompt="x" * 1_500_000))
    assert isinstance(reply, ErrorReply) and reply.code == "frame_too_large", reply
    assert "1048576" in reply.message


def test_frame_over_zmq_maxmsgsize_is_dropped_and_the_server_survives(server):
    ctx = zmq.Context.instance()
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(server.address)
    big.send(b"\x00" * (5 << 20))  # over 4 x max_frame_bytes: ZeroMQ cuts the connection
    assert not big.poll(1000), "no reply: the frame was never read"
    big.close(0)
    with Client(server.address, timeout=10) as client:
        assert client.health().status == "ok"
    assert server.proc.poll() is None


def test_multipart_message_is_malformed(sock):
    sock.send_multipart([b"a", b"b", b"c"])
    assert sock.poll(TIMEOUT_MS)
    reply = codec.decode(sock.recv())
    assert isinstance(reply, ErrorReply) and reply.code == "malformed_frame"


def test_req_socket_envelope_is_kept(server):
    req = zmq.Context.instance().socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(server.address)
    req.send(msgpack.packb({"t": "HealthRequest", "request_id": "h"}))
    assert req.poll(TIMEOUT_MS)
    reply = codec.decode(req.recv())
    req.close(0)
    assert isinstance(reply, HealthReply) and reply.request_id == "h"


def test_server_still_serves_after_all_that(server):
    with Client(server.address, timeout=10) as client:
        done = client.generate([5, 6, 7], max_tokens=4, temperature=0.0)
    assert len(done.token_ids) == 4 and done.finish_reason == "length"


# --- a bug while decoding or replying costs one frame, never the server ----------------------


@pytest.fixture
def inprocess(turned_server):
    """A real Server on a real socket, turned by the test, so a part of it can be broken."""
    with turned_server(local_engine(EngineConfig(model="random:tiny", num_threads=1))) as pair:
        yield pair


def turn_until_reply(server: Server, s: zmq.Socket, turns: int = 200) -> object | None:
    for _ in range(turns):
        server.run_once()
        if s.poll(0):
            return codec.decode(s.recv())
    return None


HEALTH = msgpack.packb({"t": "HealthRequest", "request_id": "h"})


def test_any_decoder_failure_is_an_internal_error_reply(inprocess, monkeypatch):
    server, s = inprocess

    def broken(frame: bytes, max_bytes: int) -> object:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(core_admission, "decode_request", broken)
    s.send(HEALTH)
    reply = turn_until_reply(server, s)
    assert isinstance(reply, ErrorReply) and reply.code == "internal_error", reply
    assert "recursion" in reply.message
    monkeypatch.undo()
    s.send(HEALTH)
    assert isinstance(turn_until_reply(server, s), HealthReply)


def test_frame_whose_reply_cannot_be_sent_is_dropped(inprocess, monkeypatch):
    server, s = inprocess
    real_encode = codec.encode

    def encode(msg: object) -> bytes:
        if isinstance(msg, ErrorReply):
            raise codec.CodecError("ErrorReply: cannot encode")
        return real_encode(msg)

    monkeypatch.setattr(core_admission.codec, "encode", encode)
    s.send(b"\xc1")
    assert turn_until_reply(server, s, turns=20) is None  # dropped, as docs/protocol.md says
    s.send(HEALTH)
    assert isinstance(turn_until_reply(server, s), HealthReply)
