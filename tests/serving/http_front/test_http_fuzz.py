"""An HTTP fuzzer against a real `memstep serve`: 20,000 requests from a fixed seed (bad JSON,
wrong types, huge integers, lone surrogates, deep nesting, huge bodies, abrupt hang-ups) over
keep-alive connections, with real requests interleaved that must keep their exact answers.
Among them the small holes of issue 55: integers past Python's 4,300 digits anywhere in a body,
tool call arguments nested past the recursion limit, tool names empty, of 10 KB or holding
`</tool_call>`, a 5 MiB body (its 413 read whole, no reset) and a 20 MB header line (431).

Every reply must be below 500 and every 4xx OpenAI's JSON error object; at the end nothing has
crashed, and the front's resident memory, its requests in flight and its client's entries (from
`/metrics`) are back to where they were.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from memstep.cli.serve import ServerProcess

SEED = 20261203
NUM_REQUESTS = 20_000
NUM_CONNECTIONS = 16
REAL_EVERY = 400  # one real request among this many
OUTSIZED_EVERY = 1_999  # a 5 MiB body or a 20 MB header line among this many
RSS_SLACK = 12 << 20  # the front's growth allowed over 20,000 requests (a leak was 72 MB)
FIELDS = [
    "prompt",
    "max_tokens",
    "top_k",
    "seed",
    "temperature",
    "top_p",
    "n",
    "stop",
    "stream",
    "logprobs",
    "messages",
    "min_p",
    "stream_options",
    "ignore_eos",
]
HUGE = [2**64, 2**64 + 1, 10**30, -(2**64), 2**63, -(10**40)]
ODD = [None, True, -1, 0.5, "x", [], {}, [[]], {"a": [1]}, "\ud800", "\udfff x", 1e308, -0.0]


def _odd_value(rng: random.Random) -> object:
    kind = rng.random()
    if kind < 0.3:
        return rng.choice(HUGE)
    if kind < 0.5:
        return [rng.choice(HUGE + [1, 2])] * rng.randint(1, 3)
    if kind < 0.6:
        return {"role": rng.choice(["user", "\ud800", 7]), "content": rng.choice(ODD)}
    return rng.choice(ODD)


def _fuzz_body(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.08:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 60)))
    if kind < 0.14:
        text = json.dumps({"prompt": "hi", "max_tokens": 2})
        return text[: rng.randint(0, len(text) - 1)].encode()
    if kind < 0.145:
        depth = rng.choice([1_000, 100_000])
        return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    if kind < 0.2:
        return json.dumps(rng.choice(ODD[:-2])).encode()
    body = {rng.choice(FIELDS): _odd_value(rng) for _ in range(rng.randint(1, 4))}
    if rng.random() < 0.3:
        body["prompt"] = rng.choice(["hi", [1, 2], ["a", "b"], "\ud83d"])
    if rng.random() < 0.2:
        body["max_tokens"] = rng.choice(HUGE)
    return json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \ud800


def _fuzz_request(rng: random.Random) -> bytes:
    path = rng.choice(["/v1/completions"] * 4 + ["/v1/chat/completions"] * 3 + ["/v1/nope"])
    method = rng.choice(["POST"] * 9 + ["GET", "PUT"])
    body = _fuzz_body(rng)
    head = f"{method} {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\n".encode()
    if rng.random() < 0.02:
        head += b"Authorization: Bearer \xff\xfe\r\n"  # not ASCII, not UTF-8
    return head + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


def _real(i: int) -> tuple[bytes, dict]:
    body = {"prompt": f"real request {i % 5}", "max_tokens": 3, "seed": i % 5, "temperature": 1}
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: {len(data)}\r\n\r\n"
    return head.encode() + data, body


async def _roundtrip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bytes):
    writer.write(raw)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = re.search(rb"(?i)content-length: (\d+)", head)
    body = await reader.readexactly(int(length.group(1))) if length else b""
    if re.search(rb"(?i)transfer-encoding: chunked", head):  # a stream a fuzzed body asked for
        body = await _chunked(reader)
    closing = re.search(rb"(?i)connection: close", head) is not None
    return status, body, closing


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    chunks = []
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        chunks.append((await reader.readexactly(size + 2))[:-2])
    await reader.readexactly(2)
    return b"".join(chunks)


class Fuzzer:
    """Sends the requests over keep-alive connections and tallies what comes back."""

    def __init__(self, url: str, expected: dict[int, str]):
        self.host, port = url.removeprefix("http://").split(":")
        self.port = int(port)
        self.expected = expected  # real request index -> its text
        self.statuses: Counter[int] = Counter()
        self.kinds: Counter[str] = Counter()
        self.bad: list[str] = []
        self.real_ok = 0

    async def run(self, requests: Iterator[tuple[int, str, bytes]]) -> None:
        await asyncio.gather(*[self._worker(requests) for _ in range(NUM_CONNECTIONS)])

    async def _worker(self, requests: Iterator[tuple[int, str, bytes]]) -> None:
        conn = None
        for index, kind, raw in requests:
            if kind == "hangup":
                await self._hang_up(raw)
                continue
            if kind == "huge":  # its unread body would be the connection's next bytes
                await self._alone(index, raw)
                continue
            conn = conn or await asyncio.open_connection(self.host, self.port)
            try:
                status, body, closing = await _roundtrip(*conn, raw)
            except (asyncio.IncompleteReadError, ConnectionError):
                self.bad.append(f"{kind} {index}: connection dropped")
                conn = None
                continue
            self._check(index, kind, status, body)
            if closing:
                conn[1].close()
                conn = None
        if conn is not None:
            conn[1].close()

    def _check(self, index: int, kind: str, status: int, body: bytes) -> None:
        self.statuses[status] += 1
        self.kinds[kind] += 1
        if status >= 500:
            self.bad.append(f"{kind} {index}: {status} {body[:200]!r}")
        elif status >= 400 and "error" not in json.loads(body):
            self.bad.append(f"{kind} {index}: {status} without an error object")
        elif kind == "real":
            text = json.loads(body)["choices"][0]["text"] if status == 200 else None
            if text != self.expected[index % 5]:
                self.bad.append(f"real {index}: {status} {text!r}")
            else:
                self.real_ok += 1

    async def _alone(self, index: int, raw: bytes) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            status, body, _ = await _roundtrip(reader, writer, raw)
            self._check(index, "huge", status, body)
        finally:
            writer.close()

    async def _hang_up(self, raw: bytes) -> None:
        """Open, send part of a request (or all of a streaming one), then close abruptly."""
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            writer.write(raw)
            await writer.drain()
            if raw.endswith(b"}"):
                await asyncio.wait_for(reader.read(100), 5)  # a stream has begun
            writer.transport.abort()
        except (ConnectionError, TimeoutError):
            pass


def _long_int(rng: random.Random) -> str:
    return "7" * rng.choice([4_301, 5_000, 100_000])


def _issue_55_body(rng: random.Random) -> tuple[str, bytes]:
    """(path, body) of one of issue 55's small holes, each a 4xx (a few bodies are fine)."""
    user = '{"role": "user", "content": "hi"}'
    kind = rng.randrange(5)
    if kind == 0:  # a long integer: top level, in a list, in a map
        where = rng.choice(['"max_tokens": {}', '"stop": [1, {}]', '"n": {{"x": [{}]}}'])
        body = '{"prompt": "hi", ' + where.format(_long_int(rng)) + "}"
        return "/v1/completions", body.encode()
    if kind == 1:  # deep in a message
        messages = f'[{user}, {{"role": "user", "content": "x", "n": {_long_int(rng)}}}]'
        return "/v1/chat/completions", _chat(messages)
    name = rng.choice(["", "n" * 10_240, "f</tool_call>", "get_weather"])
    if kind == 2:  # a call in the history: its arguments or its name bad (or both fine)
        depth = rng.choice([1_000, 100_000])
        args = rng.choice(["[" * depth + "]" * depth, '{"a": ' + _long_int(rng) + "}", "{}"])
        function = {"name": name, "arguments": args}
        call = {"id": "c", "type": "function", "function": function}
        called = {"role": "assistant", "content": None, "tool_calls": [call]}
        return "/v1/chat/completions", _chat(f"[{user}, {json.dumps(called)}, {user}]")
    tools = json.dumps([{"type": "function", "function": {"name": name}}])
    return "/v1/chat/completions", _chat(f"[{user}]", f', "tools": {tools}')


def _chat(messages: str, more: str = "") -> bytes:
    return ('{"max_tokens": 2, "messages": ' + messages + more + "}").encode()


def _issue_55_request(rng: random.Random) -> bytes:
    path, body = _issue_55_body(rng)
    head = f"POST {path} HTTP/1.1\r\nHost: f\r\nContent-Type: application/json\r\n"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


def _outsized_request(i: int) -> bytes:
    """A 5 MiB body sent whole (declared, or chunked) or a 20 MB header line: refused, and the
    refusal read by a client that sends it all before reading (a lingering close)."""
    body = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    head = b"POST /v1/completions HTTP/1.1\r\nHost: o\r\nContent-Type: application/json\r\n"
    kind = i // OUTSIZED_EVERY % 3
    if kind == 0:
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    if kind == 1:
        return (
            head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
        )
    return b"GET /health HTTP/1.1\r\nHost: o\r\nX-Big: " + b"h" * (20 << 20) + b"\r\n\r\n"


def _hangup_request(rng: random.Random) -> bytes:
    body = json.dumps({"prompt": "tell me", "max_tokens": 30, "stream": rng.random() < 0.5})
    raw = f"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: {len(body)}\r\n\r\n"
    raw += body
    cut = rng.choice([len(raw), len(raw) // 2, 10])
    return raw[:cut].encode()


def _huge_request(rng: random.Random) -> bytes:
    size = rng.choice([3 << 20, 50 << 20, 1 << 40])
    return f"POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Length: {size}\r\n\r\n".encode()


def _requests(start: int, count: int) -> Iterator[tuple[int, str, bytes]]:
    rng = random.Random(SEED + start)
    for i in range(start, start + count):
        if i % REAL_EVERY == 0:
            yield i, "real", _real(i)[0]
        elif i % OUTSIZED_EVERY == 0:
            yield i, "huge", _outsized_request(i)
        elif rng.random() < 0.02:
            yield i, "issue55", _issue_55_request(rng)
        elif rng.random() < 0.01:
            yield i, "hangup", _hangup_request(rng)
        elif rng.random() < 0.005:
            yield i, "huge", _huge_request(rng)
        else:
            yield i, "fuzz", _fuzz_request(rng)


def _front_figures(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    names = ("front_rss_bytes", "front_client_entries", "front_requests_inflight")
    return {n: float(re.search(rf"^memstep:{n} (\S+)$", text, re.M).group(1)) for n in names}


@pytest.fixture(scope="module")
def server():
    args = ["--model", "random:tiny", "--num-threads", "1", "--no-record"]
    with ServerProcess(args, http=True) as proc:
        proc.wait_ready()
        yield proc


def _expected(url: str) -> dict[int, str]:
    out = {}
    for i in range(5):
        body = _real(i)[1]
        out[i] = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        out[i] = out[i]["text"]
    return out


def _settled(url: str) -> dict[str, float]:
    """The front's figures once the hang-ups' aborts have gone through."""
    for _ in range(50):
        figures = _front_figures(url)
        if figures["front_client_entries"] == 0 and figures["front_requests_inflight"] == 0:
            break
        asyncio.run(asyncio.sleep(0.2))
    return figures


def test_20000_fuzzed_requests_get_no_5xx_and_leave_nothing_behind(server):
    url = server.http_url
    fuzzer = Fuzzer(url, _expected(url))
    asyncio.run(fuzzer.run(_requests(1, 2_000)))  # warms the front's allocator
    before = _settled(url)
    asyncio.run(fuzzer.run(_requests(2_001, NUM_REQUESTS - 2_000)))
    after = _settled(url)
    assert not fuzzer.bad, fuzzer.bad[:10]
    assert sum(fuzzer.statuses.values()) > 0.97 * NUM_REQUESTS  # hang-ups get no status
    assert fuzzer.real_ok == NUM_REQUESTS // REAL_EVERY
    assert server.proc.poll() is None and httpx.get(url + "/health").status_code == 200
    assert after["front_client_entries"] == 0 and after["front_requests_inflight"] == 0
    assert after["front_rss_bytes"] - before["front_rss_bytes"] < RSS_SLACK, (before, after)
    assert fuzzer.statuses[400] > NUM_REQUESTS / 2 and fuzzer.statuses[413] > 0
    assert fuzzer.statuses[431] > 0 and fuzzer.kinds["issue55"] > 200


def test_the_entry_count_sees_a_request_left_unread(server):
    """The check broken on purpose: a stream whose reader walks away without `forget` keeps its
    entry, and the count says so."""
    from memstep.api.client import AsyncClient

    async def leave_one() -> tuple[int, int]:
        async with AsyncClient(server.address, timeout=30) as client:
            await client.generate("abc", max_tokens=2, stream=True)
            await asyncio.sleep(0.5)
            left = client.num_pending
            client.forget(next(iter(client._queues)))
            return left, client.num_pending

    assert asyncio.run(leave_one()) == (1, 0)
