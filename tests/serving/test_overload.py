"""The waiting bound (`--max-waiting-requests`): a burst past it is refused with the typed
`overloaded` error over ZMQ and 503 + Retry-After over HTTP, counted in /metrics, while every
admitted request finishes with its full text."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from memstep.api.client import AsyncClient, Overloaded, ServerError
from memstep.cli.serve import ServerProcess
from memstep.core.config import ConfigError
from memstep.serving.core_config import ServerConfig

TINY = ["--model", "random:tiny", "--num-threads", "1", "--max-num-seqs", "2"]
BURST, MAX_TOKENS = 12, 24


@pytest.fixture(scope="module")
def bounded():
    with ServerProcess([*TINY, "--max-waiting-requests", "2"], http=True) as server:
        server.wait_ready()
        yield server


async def zmq_burst(address: str) -> list[object]:
    """BURST requests sent at once; each one's GenerateDone or the error it raised."""
    client = AsyncClient(address, timeout=120)
    try:
        calls = [
            client.generate(f"request {i} says", max_tokens=MAX_TOKENS, ignore_eos=True)
            for i in range(BURST)
        ]
        return list(await asyncio.gather(*calls, return_exceptions=True))
    finally:
        await client.close()


async def http_burst(url: str, stream: bool) -> list[httpx.Response]:
    body = {"model": "m", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}
    async with httpx.AsyncClient(timeout=120) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        calls = [
            http.post(f"{url}/v1/completions", json={**body, "model": model, "prompt": f"p{i}"})
            for i in range(BURST)
        ]
        return list(await asyncio.gather(*calls))


def refused_count(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r'^memstep:requests_refused_total\{code="overloaded"\} (\S+)$', text, re.M)
    return int(float(found.group(1))) if found else 0


def test_zmq_refuses_past_the_bound_with_the_typed_error_and_finishes_the_admitted(bounded):
    before = refused_count(bounded.http_url)
    results = asyncio.run(zmq_burst(bounded.address))
    refused = [r for r in results if isinstance(r, ServerError)]
    done = [r for r in results if not isinstance(r, BaseException)]
    assert len(refused) + len(done) == BURST
    assert refused and all(isinstance(r, Overloaded) and r.code == "overloaded" for r in refused)
    assert len(done) >= 2  # the running batch's worth at least
    for d in done:  # nothing admitted is lost or cut short
        assert d.finish_reason == "length" and len(d.token_ids) == MAX_TOKENS and d.text
    assert refused_count(bounded.http_url) - before == len(refused)


@pytest.mark.parametrize("stream", [False, True])
def test_http_refuses_past_the_bound_with_503_and_retry_after(bounded, stream):
    before = refused_count(bounded.http_url)
    replies = asyncio.run(http_burst(bounded.http_url, stream))
    refused = [r for r in replies if r.status_code == 503]
    served = [r for r in replies if r.status_code == 200]
    assert len(refused) + len(served) == BURST and refused and len(served) >= 2
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
    for r in served:
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in r.text
        else:
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length" and choice["text"]
            assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert refused_count(bounded.http_url) - before == len(refused)


def test_without_the_bound_the_same_burst_is_all_served():
    """The check is what refuses: the same server with no bound queues every request."""
    with ServerProcess(TINY) as server:
        server.wait_ready()
        results = asyncio.run(zmq_burst(server.address))
    assert not [r for r in results if isinstance(r, BaseException)]
    assert all(len(r.token_ids) == MAX_TOKENS for r in results)  # type: ignore[attr-defined]


def test_a_negative_bound_is_a_config_error():
    with pytest.raises(ConfigError, match="max_waiting_requests"):
        ServerConfig(max_waiting_requests=-1)
