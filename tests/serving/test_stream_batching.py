"""A client's streams in one frame a step (GenerateDeltas), and the front's SSE chunks as bytes."""

from __future__ import annotations

import asyncio
import threading

import msgpack
import orjson
import pytest
import zmq

from memstep.api.client import AsyncClient, Client
from memstep.core.config import EngineConfig
from memstep.events import codec
from memstep.events.wire import GenerateDelta, GenerateDeltas, GenerateDone, GenerateRequest
from memstep.executors.process.inprocess import local_engine
from memstep.serving.core_process import Server
from memstep.serving.http_front import openai_protocol as oai
from memstep.serving.http_front.sse import event

NUM_STREAMS = 4
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def served(turned_server):
    with turned_server(local_engine(EngineConfig(model="random:tiny", num_threads=1))) as pair:
        yield pair


def _requests(s: zmq.Socket, batch: bool, tag: str) -> list[str]:
    ids = [f"{tag}{i}" for i in range(NUM_STREAMS)]
    params = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "seed": 7}
    for i, rid in enumerate(ids):
        msg = GenerateRequest(
            rid, prompt_token_ids=[5 + i, 6, 7], params=params, stream=True, batch_deltas=batch
        )
        s.send(codec.encode(msg))
    return ids


def _frames(server: Server, s: zmq.Socket, num_done: int) -> list[object]:
    """Turn the server until `num_done` GenerateDone came; every frame, decoded, in order.  The
    requests sent are all taken before the first turn (on a loaded machine the first turn's read
    may find only some of them arrived: the rest would start a step later, in frames of their
    own)."""
    for _ in range(500):
        if len(server.engine.scheduler.waiting) == num_done:
            break
        server._receive(0.01)
    got: list[object] = []
    for _ in range(500):
        server.run_once()
        while s.poll(0):
            got.append(codec.decode(s.recv()))
        if sum(isinstance(msg, GenerateDone) for msg in got) == num_done:
            return got
    raise AssertionError(f"not {num_done} GenerateDone in 500 turns: {got}")


def _tokens(frames: list[object]) -> dict[str, list[int]]:
    """Each request's streamed tokens, from single deltas and batches alike."""
    out: dict[str, list[int]] = {}
    for msg in frames:
        deltas = msg.deltas if isinstance(msg, GenerateDeltas) else [msg]
        for d in deltas:
            if isinstance(d, GenerateDelta):
                out.setdefault(d.request_id, []).extend(d.token_ids)
    return out


def test_a_client_that_asks_gets_one_frame_a_step_for_all_its_streams(served):
    """With batch_deltas the four streams' tokens of a step come in one GenerateDeltas (a frame
    a step, not one a request), each request's GenerateDone after its last delta, and the tokens
    are those the same requests stream one frame each (the check fires: without the flag, no
    GenerateDeltas comes and there are four times the frames)."""
    server, s = served
    batched = _frames(server, s, NUM_STREAMS) if _requests(s, True, "b") else []
    single = _frames(server, s, NUM_STREAMS) if _requests(s, False, "s") else []
    kinds = [type(msg) for msg in batched]
    assert set(kinds) == {GenerateDeltas, GenerateDone}, kinds
    assert kinds.count(GenerateDeltas) == MAX_TOKENS
    assert all(len(msg.deltas) == NUM_STREAMS for msg in batched if isinstance(msg, GenerateDeltas))
    assert GenerateDeltas not in {type(msg) for msg in single}
    assert [type(msg) for msg in single].count(GenerateDelta) == NUM_STREAMS * MAX_TOKENS
    last_delta = max(i for i, k in enumerate(kinds) if k is GenerateDeltas)
    assert min(i for i, k in enumerate(kinds) if k is GenerateDone) > last_delta
    streamed = _tokens(batched)
    assert {rid[1:]: toks for rid, toks in streamed.items()} == {
        rid[1:]: toks for rid, toks in _tokens(single).items()
    }
    dones = {msg.request_id: msg.token_ids for msg in batched if isinstance(msg, GenerateDone)}
    assert dones == streamed and all(len(t) == MAX_TOKENS for t in dones.values())


def test_a_batch_of_deltas_travels_as_rows_and_decodes_strictly():
    """Deltas in a GenerateDeltas are arrays (no keys); one of the wrong length is refused."""
    deltas = [GenerateDelta("a", [1], "x"), GenerateDelta("b", [2, 3], "yz", [[2, "y", -0.5, []]])]
    data = codec.encode(GenerateDeltas(deltas))
    assert codec.unpack(data)["deltas"][0] == ["a", [1], "x", [], []]
    assert codec.decode(data) == GenerateDeltas(deltas)
    bad = codec.unpack(data)
    bad["deltas"][0] = ["a", [1]]
    with pytest.raises(codec.CodecError, match="GenerateDelta"):
        codec.decode(msgpack.packb(bad, use_bin_type=True))


def test_the_async_client_streams_batched_what_the_blocking_client_streams(served):
    """AsyncClient asks for batches (and reads every frame that came at once); its streams'
    text and tokens equal the blocking client's, which streams a frame a request."""
    server, _ = served
    stop = threading.Event()

    async def batched() -> dict[str, tuple[str, list[int]]]:
        async with AsyncClient(server.endpoint, timeout=30) as client:
            streams = [
                await client.generate([9 + i, 4], stream=True, max_tokens=6, seed=i)
                for i in range(NUM_STREAMS)
            ]
            out = {}
            for i, stream in enumerate(streams):
                text, ids = "", []
                async for delta in stream:
                    text, ids = text + delta.text, ids + delta.token_ids
                assert stream.result is not None and stream.result.token_ids == ids
                out[str(i)] = (text, ids)
            return out

    def turn() -> None:
        while not stop.is_set():
            server.run_once()

    thread = threading.Thread(target=turn, daemon=True)
    thread.start()
    try:
        got = asyncio.run(batched())
        with Client(server.endpoint, timeout=30) as client:
            want = {}
            for i in range(NUM_STREAMS):
                deltas = list(client.generate([9 + i, 4], stream=True, max_tokens=6, seed=i))
                ids = [t for d in deltas for t in d.token_ids]
                want[str(i)] = ("".join(d.text for d in deltas), ids)
    finally:
        stop.set()
        thread.join(10)
    assert got == want and all(len(ids) == 6 for _, ids in got.values())


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_plain_text_chunk_from_bytes_is_the_chunk_json(chat, include_usage):
    """TextChunks' event is byte for byte `event(chunk(...))` for texts JSON must escape, and
    a model name holding its marker gets none (the slow path) rather than a broken chunk."""
    job = oai.Job(chat, 'mo"del', [{"prompt": "x"}], [{}], 1, True, include_usage, None)
    plain = oai.TextChunks.of(job, 'cmpl-"created":1', 0)
    assert plain is not None
    for text in ["a", 'q"uo\\te', "\n\t\x01", "é漢字🙂", "\ue000memstep-text\ue000"]:
        want = oai.chunk(job, 'cmpl-"created":1', 0, text, [], 0)
        got = plain.event(text, want["created"])
        assert got == event(want)
        assert orjson.loads(got[len(b"data: ") :]) == want
    odd = oai.Job(chat, oai.TextChunks.MARK, [{"prompt": "x"}], [{}], 1, True, include_usage, None)
    assert oai.TextChunks.of(odd, "cmpl-1", 0) is None
