"""One served run with every event of a request's life: a prefix hit, preemptions (10 KV pages
for 6 streams), an executor SIGKILLed from outside mid-stream and recovered, an HTTP request
named by `X-Request-Id`, two in flight at once under one `X-Request-Id`, a request the core
rejects and two the HTTP front rejects."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from pathlib import Path

import httpx

from memstep.api.client import AsyncClient, Client, ServerError
from memstep.cli.serve import ServerProcess

ARGS = ["--model", "random:tiny", "--num-threads", "1", "--num-kv-blocks", "10"]
SHARED = list(range(1, 40))  # 39 tokens: two full pages the prefix cache keeps
STREAMS = [[*SHARED, 40 + i] for i in range(6)]
X_REQUEST_ID = "trace-me-41"
TWICE = "sent-twice-41"


def serve_and_drive(into: Path) -> tuple[Path, list[dict], dict]:
    seen: dict = {}
    args = [*ARGS, "--log-format", "json"]
    with ServerProcess(args, log_level="debug", http=True) as server:
        info = server.wait_ready()
        with Client(server.address, timeout=60) as client:
            seen["first"] = client.generate(
                SHARED + [99], request_id="warm", max_tokens=4, temperature=0.0
            )
            try:
                client.generate("", request_id="empty", max_tokens=4)
            except ServerError as exc:
                seen["rejected"] = exc.code
        seen["streams"] = asyncio.run(_streams(server.address, info["executor_pid"]))
        seen["http"] = _http(server.http_url)
        assert server.stop() == 0
        shutil.copy(server.dir / "events.memlog", into / "events.memlog")
        text = server.log_path.read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return into / "events.memlog", lines, seen


async def _streams(address: str, executor_pid: int) -> list:
    """Six streams of 40 tokens into 10 pages (three run, preempting one another as they grow);
    the executor is SIGKILLed once one stream has 10 tokens."""
    pid = [executor_pid]

    async def one(client: AsyncClient, i: int) -> list[int]:
        rid = f"zmq-{i}"
        stream = await client.generate(
            STREAMS[i],
            stream=True,
            request_id=rid,
            max_tokens=40,
            ignore_eos=True,
            seed=i,
            temperature=0.0,
        )
        tokens: list[int] = []
        async for delta in stream:
            tokens += delta.token_ids
            if len(tokens) >= 10 and pid[0]:
                os.kill(pid.pop(), signal.SIGKILL)
                pid.append(0)
        return tokens

    client = AsyncClient(address, timeout=120)
    try:
        return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(6))), 240)
    finally:
        await client.close()


def _http(url: str) -> dict:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": SHARED[:20], "max_tokens": 5, "ignore_eos": True}
    named = httpx.post(
        url + "/v1/completions", json=body, headers={"X-Request-Id": X_REQUEST_ID}, timeout=60
    )
    bad = httpx.post(
        url + "/v1/completions", content=b"{", headers={"X-Request-Id": "bad-1"}, timeout=60
    )
    spaced = httpx.post(
        url + "/v1/completions", json=body, headers={"X-Request-Id": "a b"}, timeout=60
    )
    return {"named": named, "bad": bad, "spaced": spaced, "twice": asyncio.run(_twice(url, body))}


async def _twice(url: str, body: dict) -> list[httpx.Response]:
    """Two requests in flight at once under one `X-Request-Id` (a stream and a whole one)."""
    headers = {"X-Request-Id": TWICE}
    async with httpx.AsyncClient(timeout=60) as client:
        post, body = url + "/v1/completions", {**body, "max_tokens": 12}
        whole = client.post(post, json=body, headers=headers)
        streamed = client.post(post, json={**body, "stream": True}, headers=headers)
        return list(await asyncio.gather(whole, streamed))
