"""The front's connections are bounded: thousands of idle ones leave real requests answered and
are closed by the request-head deadline, slowloris included, and past --max-connections new
ones are closed as they open."""

from __future__ import annotations

import asyncio
import re
import resource
import time

import httpx
import pytest

from memstep.cli.serve import ServerProcess

NUM_IDLE = 5_000
HEADER_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def server():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, NUM_IDLE + 1024), hard))
    args = ["--model", "random:tiny", "--num-threads", "1", "--no-record"]
    args += ["--header-timeout", str(HEADER_TIMEOUT_S), "--max-connections", "6000"]
    try:
        with ServerProcess(args, http=True) as proc:
            proc.wait_ready()
            yield proc
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(rf"^memstep:{name} (\S+)$", text, re.M).group(1))


async def _open(port: int, count: int) -> list[asyncio.StreamWriter]:
    writers = []
    for _ in range(count):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writers.append(writer)
    return writers


async def _closed_by_server(writers: list[asyncio.StreamWriter], within: float) -> int:
    """How many of the connections the server closed within `within` seconds."""

    async def closed(writer: asyncio.StreamWriter) -> bool:
        reader = writer._protocol._stream_reader  # type: ignore[attr-defined]
        try:
            return await asyncio.wait_for(reader.read(1), within) == b""
        except ConnectionError:  # reset: closed all the same
            return True
        except TimeoutError:
            return False

    return sum(await asyncio.gather(*[closed(w) for w in writers]))


async def _idle_then_real(url: str) -> tuple[float, float, int, int]:
    writers = await _open(_port(url), NUM_IDLE)
    async with httpx.AsyncClient(timeout=30) as client:
        start = time.monotonic()
        health = await client.get(url + "/health")
        health_s = time.monotonic() - start
        start = time.monotonic()
        body = {"prompt": "hello", "max_tokens": 2}
        real = await client.post(url + "/v1/completions", json=body)
        real_s = time.monotonic() - start
    assert health.status_code == 200 and real.status_code == 200
    num_closed = await _closed_by_server(writers, HEADER_TIMEOUT_S + 10)
    for writer in writers:
        writer.close()
    return health_s, real_s, num_closed, len(writers)


def test_5000_idle_connections_leave_requests_answered_and_are_closed(server):
    health_s, real_s, num_closed, num_opened = asyncio.run(_idle_then_real(server.http_url))
    assert health_s < 1.0 and real_s < 1.0, (health_s, real_s)
    assert num_closed == num_opened == NUM_IDLE
    assert _metric(server.http_url, "front_connections_timed_out_total") >= NUM_IDLE


async def _slowloris(port: int) -> tuple[bool, float]:
    """A request head sent a byte every half second: closed at the deadline all the same."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    head = b"GET /health HTTP/1.1\r\nHost: slow\r\nX-Padding: " + b"a" * 100
    try:
        for byte in head:
            writer.write(bytes([byte]))
            await writer.drain()
            if reader.at_eof():
                break
            await asyncio.sleep(0.5)
        closed = await asyncio.wait_for(reader.read(1), 5) == b""
    except ConnectionError:
        closed = True
    writer.close()
    return closed, time.monotonic() - start


def test_a_slowloris_connection_is_closed_at_the_header_deadline(server):
    closed, took = asyncio.run(_slowloris(_port(server.http_url)))
    assert closed and took < HEADER_TIMEOUT_S + 3


def test_past_max_connections_new_ones_are_closed_as_they_open():
    args = ["--model", "random:tiny", "--num-threads", "1", "--no-record"]
    with ServerProcess([*args, "--max-connections", "50"], http=True) as proc:
        proc.wait_ready()
        url = proc.http_url

        async def flood() -> int:
            writers = await _open(_port(url), 80)
            num_closed = await _closed_by_server(writers, 2.0)
            for writer in writers:
                writer.close()
            return num_closed

        num_closed = asyncio.run(flood())
        time.sleep(0.5)  # the server sees the others close
        assert num_closed == 30
        assert _metric(url, "front_connections_refused_total") == 30
