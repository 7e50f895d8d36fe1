"""One request never stalls the others: large bodies beside streams, frames past the core's
limit, a lost link to the core, and the small refusals (API key scheme, no Host header)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from memstep.api.client import AsyncClient, Client, ServerError
from memstep.cli.serve import ServerProcess

MIB = 1 << 20
NUM_STREAMS = 8
STREAM_TOKENS = 40


@pytest.fixture(scope="module")
def server():
    args = ["--model", "random:tiny", "--num-threads", "1", "--no-record", "--seed", "3"]
    with ServerProcess(args, http=True) as proc:
        proc.wait_ready()
        yield proc


def _stream_body(i: int) -> dict:
    prompt = f"stream {i} says"
    return {"prompt": prompt, "max_tokens": STREAM_TOKENS, "seed": 100 + i, "stream": True}


def _token_ids_body(num_bytes: int) -> bytes:
    """A completion whose prompt is token ids, `num_bytes` long in all."""
    head, tail = b'{"max_tokens": 4, "prompt": [', b"]}"
    count = (num_bytes - len(head) - len(tail) + 1) // 6
    body = head + b",".join([b"12345"] * count) + tail
    return body + b" " * (num_bytes - len(body))  # padded to the byte


async def _sse_text(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, bool]:
    """The streamed text and whether [DONE] ended it."""
    text, done = "", False
    async with client.stream("POST", url + "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += event["choices"][0]["text"]
    return text, done


async def _large_beside_streams(url: str, size: int) -> tuple[list, httpx.Response, float]:
    async with httpx.AsyncClient(timeout=120) as client:
        alone = await asyncio.gather(
            *[_sse_text(client, url, _stream_body(i)) for i in range(NUM_STREAMS)]
        )
        streams = [
            asyncio.create_task(_sse_text(client, url, _stream_body(i))) for i in range(NUM_STREAMS)
        ]
        await asyncio.sleep(0.3)  # the streams are under way
        start = time.monotonic()
        big = await client.post(
            url + "/v1/completions",
            content=_token_ids_body(size),
            headers={"content-type": "application/json"},
        )
        took = time.monotonic() - start
        beside = await asyncio.gather(*streams)
    assert all(done for _, done in alone)
    return list(zip(alone, beside, strict=True)), big, took


@pytest.mark.parametrize("size", [1 * MIB, 4 * MIB, 5 * MIB], ids=["1MiB", "4MiB", "5MiB"])
def test_a_large_request_beside_8_streams_is_refused_and_they_finish(server, size):
    pairs, big, took = asyncio.run(_large_beside_streams(server.http_url, size))
    assert big.status_code in (400, 413), big.text
    error = big.json()["error"]
    assert error["code"] in {"request_too_large", "invalid_request", "invalid_value"}, error
    assert took < 1.0, f"the large request took {took:.2f} s"
    for alone, beside in pairs:
        assert beside == alone and beside[1]  # the same whole text, ended by [DONE]
    assert httpx.get(server.http_url + "/health").status_code == 200


def test_a_body_past_the_limit_is_refused_before_it_is_read(server):
    """Content-Length alone decides: no byte of the body is sent."""
    with socket.create_connection(("127.0.0.1", int(server.http_url.rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n")
        s.settimeout(5)
        reply = b""
        while b"request_too_large" not in reply and (chunk := s.recv(4096)):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413") and b"request_too_large" in reply


def test_frame_too_large_names_its_request_so_the_client_gets_it(server):
    """Between the core's limit and 4x it, the core answers frame_too_large with the request's
    id; before, the reply had none and the request waited for its timeout."""
    with Client(server.address, timeout=30) as client:
        start = time.monotonic()
        with pytest.raises(ServerError) as err:
            client.generate([30000] * 600_000, max_tokens=2)  # ~1.8 MB of msgpack
        assert err.value.code == "frame_too_large" and time.monotonic() - start < 5
        assert client.health().status == "ok"


async def _stream_then_huge_frame(address: str, checked: bool) -> tuple[str, int]:
    """A stream under way, then a frame past the core's hard limit (4x its frame limit) on
    the same link: the error each gets, and the entries left."""
    limit = 1 << 20 if checked else None
    async with AsyncClient(address, timeout=60, max_frame_bytes=limit) as client:
        stream = await client.generate("a long story", max_tokens=400, stream=True, seed=1)
        with pytest.raises(ServerError) as big:
            await client.generate([30000] * 2_000_000, max_tokens=2)  # ~6 MB
        try:
            async for _ in stream:
                pass
            outcome = stream.result.finish_reason if stream.result else "none"
        except ServerError as exc:
            outcome = exc.code
        assert big.value.code in {"frame_too_large", "route_lost"}
        return outcome, client.num_pending


def test_the_client_checks_the_frame_limit_so_the_link_survives(server):
    outcome, left = asyncio.run(_stream_then_huge_frame(server.address, checked=True))
    assert (outcome, left) == ("length", 0)


def test_unchecked_a_huge_frame_closes_the_link_and_the_stream_ends_route_lost(server):
    """The check broken on purpose: ZeroMQ drops the link, and the stream on it ends with
    route_lost at once instead of waiting for replies that cannot come."""
    start = time.monotonic()
    outcome, left = asyncio.run(_stream_then_huge_frame(server.address, checked=False))
    assert (outcome, left) == ("route_lost", 0) and time.monotonic() - start < 30


def test_the_bearer_scheme_is_required_in_any_case(tmp_path):
    (tmp_path / "key").write_text("s3cret\n")
    args = ["--model", "random:tiny", "--num-threads", "1", "--no-record"]
    with ServerProcess([*args, "--api-key-file", str(tmp_path / "key")], http=True) as proc:
        proc.wait_ready()
        url = proc.http_url + "/v1/models"
        codes = [
            httpx.get(url, headers={"authorization": auth}).status_code
            for auth in (
                "Bearer s3cret",
                "bearer s3cret",
                "BEARER s3cret",
                "s3cret",
                "Basic s3cret",
            )
        ]
    assert codes == [200, 200, 200, 401, 401]


def test_a_request_without_host_is_a_400_json_error(server):
    with socket.create_connection(("127.0.0.1", int(server.http_url.rsplit(":", 1)[1]))) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n\r\n")
        s.settimeout(5)
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json.loads(body)["error"]["code"] == "invalid_http"


def _sent_whole_then_read(server, raw: bytes) -> tuple[bytes, dict]:
    """Send all of `raw` (as most clients do before reading), then read to the close: a reset
    on either side fails the test; (the reply's head, its JSON body)."""
    with socket.create_connection(("127.0.0.1", int(server.http_url.rsplit(":", 1)[1]))) as s:
        s.sendall(raw)
        s.settimeout(10)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return head, json.loads(body)


@pytest.mark.parametrize("close", [False, True], ids=["keep-alive", "connection-close"])
@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_a_5_mib_body_gets_its_413_read_not_a_reset(server, close, chunked):
    """The front answers 413 at 2 MiB and lingers: it reads and drops the rest, so the client's
    send of 5 MiB completes and it reads the refusal (a plain close reset the connection)."""
    body = _token_ids_body(5 * MIB)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    head += b"Connection: close\r\n" if close else b""
    if chunked:
        raw = head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    else:
        raw = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    reply_head, error = _sent_whole_then_read(server, raw)
    assert reply_head.startswith(b"HTTP/1.1 413") and b"connection: close" in reply_head.lower()
    assert error["error"]["code"] == "request_too_large"


def test_a_20_mb_header_line_is_a_431_and_the_front_goes_on(server):
    """Read no further than the bound (MAX_HEAD_BYTES, docs/limits.md): a 20 MB header line was
    read whole and answered 200."""
    raw = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"h" * (20 * MIB) + b"\r\n\r\n"
    head, error = _sent_whole_then_read(server, raw)
    assert head.startswith(b"HTTP/1.1 431") and error["error"]["code"] == "request_header_too_large"
    assert httpx.get(server.http_url + "/health").status_code == 200


def test_a_head_within_the_bound_is_served(server):
    """The bound leaves room for any real client's headers: 60 KB of them are served."""
    from memstep.serving.http_front.http_limits import MAX_HEAD_BYTES

    headers = {f"x-h{i}": "v" * 1000 for i in range(60)}
    assert sum(len(k) + len(v) + 4 for k, v in headers.items()) < MAX_HEAD_BYTES
    assert httpx.get(server.http_url + "/health", headers=headers).status_code == 200
