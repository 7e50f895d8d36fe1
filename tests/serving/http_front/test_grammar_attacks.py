"""Issue 55's attacks on structured outputs, each against a real `memstep serve` (SmolLM2) with
4 plain streams running beside it: the attack gets a 4xx with the reason, no stream pauses more
than a second, /health stays 200 and the server serves on.  The constraints are refused by
their bounds before any compile (events/grammar_limits.py) or by a check in a worker process
(core/grammar_check.py); ids from the socket are range-checked at the door."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import zmq
import zmq.asyncio

from memstep.api.client import AsyncClient
from memstep.cli.serve import ServerProcess
from memstep.events import codec
from memstep.events.wire import ErrorReply, GenerateRequest

NUM_STREAMS = 4
MAX_GAP_S = 1.0


def ref_chain(depth: int, pointer: str = "#/$defs/") -> dict:
    """A schema whose every level is a `$ref` to the next (1,000 deep: ~60 KB)."""
    defs = {
        f"a{i}": {"type": "array", "items": {"$ref": f"{pointer}a{i + 1}"}} for i in range(depth)
    }
    defs[f"a{depth}"] = {"type": "string"}
    return {"$ref": f"{pointer}a0", "$defs": defs}


def gbnf_chain(rules: int) -> str:
    body = "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(rules))
    return f'root ::= r0\n{body}r{rules} ::= "b"\n'


ASK = [{"role": "user", "content": "Answer."}]
ATTACKS = {
    "ref chain in response_format": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": ref_chain(1000)},
        }
    },
    "ref chain in a forced tool call": {
        "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": ref_chain(1000)}}],
    },
    "10k-rule GBNF chain": {"guided_grammar": gbnf_chain(10_000)},
    "100k-string choice": {"guided_choice": [f"option {i}" for i in range(100_000)]},
    "empty choice": {"guided_choice": []},
    "GBNF syntax error": {"guided_grammar": 'root ::= ( "a" \n'},
    "a choice the parser cannot enforce": {"guided_choice": [f"c {i}" for i in range(3500)]},
}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--model", "smollm2", "--max-num-seqs", "8"], http=True) as proc:
        proc.wait_ready(timeout=300)
        yield proc


async def _stream_gaps(stream) -> float:
    """The longest pause between a stream's deltas, from its first to its end."""
    last, longest = None, 0.0
    async for _ in stream:
        now = time.monotonic()
        if last is not None:
            longest = max(longest, now - last)
        last = now
    return longest


async def beside_streams(address: str, attack) -> tuple[object, list[float]]:
    """`attack()`'s result, made while NUM_STREAMS plain streams run, and their longest pauses."""
    client = AsyncClient(address, timeout=120)
    try:
        streams = [
            await client.generate(
                f"Count to forty, step {i}:",
                stream=True,
                max_tokens=40,
                ignore_eos=True,
                temperature=0.0,
            )
            for i in range(NUM_STREAMS)
        ]
        readers = [asyncio.create_task(_stream_gaps(s)) for s in streams]
        await asyncio.sleep(0.5)  # every stream under way
        result = await attack()
        return result, list(await asyncio.gather(*readers))
    finally:
        await client.close()


async def _http_attack(url: str, extra: dict) -> httpx.Response:
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 8, **extra}
    async with httpx.AsyncClient(timeout=120) as http:
        return await http.post(f"{url}/v1/chat/completions", json=body)


@pytest.mark.parametrize("name", list(ATTACKS))
def test_each_attack_is_a_4xx_and_no_stream_beside_it_pauses(server, name):
    start = time.monotonic()
    reply, gaps = asyncio.run(
        beside_streams(server.address, lambda: _http_attack(server.http_url, ATTACKS[name]))
    )
    assert 400 <= reply.status_code < 500, reply.text[:500]
    error = reply.json()["error"]
    assert error["message"] and len(error["message"]) < 1000 and "Traceback" not in reply.text
    assert max(gaps) < MAX_GAP_S, gaps
    assert httpx.get(f"{server.http_url}/health", timeout=5).status_code == 200
    assert time.monotonic() - start < 60
    ok = httpx.post(
        f"{server.http_url}/v1/completions",
        timeout=60,
        json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2},
    ).json()
    assert ok["choices"][0]["text"]


async def _zmq_generate(address: str, request: GenerateRequest) -> object:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        await sock.send(codec.encode(request))
        return codec.decode(await asyncio.wait_for(sock.recv(), 30))
    finally:
        sock.close(0)


@pytest.mark.parametrize("ids", [[-5], [10**6], [1, 2, 49152]])
def test_output_token_ids_outside_the_vocabulary_are_invalid_requests(server, ids):
    request = GenerateRequest(
        "m1", prompt="Hi", params={"seed": 1, "max_tokens": 8}, output_token_ids=ids
    )
    reply, gaps = asyncio.run(
        beside_streams(server.address, lambda: _zmq_generate(server.address, request))
    )
    assert isinstance(reply, ErrorReply) and reply.code == "invalid_request", reply
    assert "outside the vocabulary" in reply.message
    assert max(gaps) < MAX_GAP_S, gaps
    assert httpx.get(f"{server.http_url}/health", timeout=5).status_code == 200


def test_the_unenforceable_and_the_refused_are_counted_in_metrics(server):
    text = httpx.get(f"{server.http_url}/metrics", timeout=10).text
    assert 'memstep:request_success_total{finished_reason="constraint_unenforceable"}' in text
    assert "memstep:constraint_cache_bytes" in text and "memstep:grammar_cache_bytes" in text


def test_a_stream_whose_constraint_cannot_be_enforced_ends_with_an_error_event(server):
    body = {
        "model": "smollm2",
        "messages": ASK,
        "max_tokens": 8,
        "stream": True,
        **ATTACKS["a choice the parser cannot enforce"],
    }
    reply = httpx.post(f"{server.http_url}/v1/chat/completions", json=body, timeout=60)
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", reply.text[-500:]
    errors = [json.loads(e)["error"] for e in events[:-1] if '"error"' in e]
    assert errors and errors[0]["code"] == "constraint_unenforceable", reply.text[-500:]
    texts = "".join(
        choice["delta"].get("content") or ""
        for e in events[:-1]
        if '"error"' not in e
        for choice in json.loads(e)["choices"]
    )
    assert any(
        c.startswith(texts) for c in ATTACKS["a choice the parser cannot enforce"]["guided_choice"]
    )
