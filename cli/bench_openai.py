"""`bench serve`'s OpenAI backends: one streamed request to `/v1/completions` ("openai") or
`/v1/chat/completions` ("openai-chat") of memstep's HTTP front or any OpenAI-compatible server.

Times are taken as by the ZMQ backend and by vLLM's `benchmark_serving.py`: each SSE chunk of a
choice is one arrival, with text or without (`is_token`), and TTFT is the first one's.  Counting
only chunks with text would time a reply whose first tokens have none (a character split over
tokens, or a random model's ids that the tokenizer has no text for) from its first text.  The
token counts come from the server's `usage` (asked for with `stream_options.include_usage`).
The client is aiohttp, as vLLM's `benchmark_serving.py` (httpx spent about twice its CPU a
chunk, and a busy client's late reads count as the server's latency).
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import attrs
import orjson

BACKENDS = ("zmq", "openai", "openai-chat")


class HttpError(RuntimeError):
    """A non-200 answer or an error event; the message is the server's."""


@attrs.define
class Streamed:
    """When each text chunk of one request arrived (perf_counter), and the usage it reported."""

    start: float
    arrivals: list[float] = attrs.Factory(list)
    prompt_tokens: int = 0
    completion_tokens: int = 0


HTTP_ERRORS = (aiohttp.ClientError, TimeoutError)  # a connection's failures, besides HttpError


def session(timeout: float) -> aiohttp.ClientSession:
    """One client for a whole run, without a cap on its connections (each stream holds one)."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout),
        connector=aiohttp.TCPConnector(limit=0),
    )


async def model_id(http: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists."""
    async with http.get(f"{base_url}/v1/models") as reply:
        reply.raise_for_status()
        return str((await reply.json())["data"][0]["id"])


def request_body(chat: bool, model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> dict:
    """A greedy streaming request, as the ZMQ backend sends (temperature 0, the same limits)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extra, which memstep's front also takes
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def stream(http: aiohttp.ClientSession, base_url: str, chat: bool, body: dict) -> Streamed:
    """One streamed request; the SSE events are split from the raw bytes as they come (a line
    iterator and json cost the client more CPU a token than the server's front spends)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    out = Streamed(time.perf_counter())
    headers = {"Content-Type": "application/json"}
    async with http.post(base_url + path, data=orjson.dumps(body), headers=headers) as reply:
        if reply.status != 200:
            text = (await reply.read()).decode(errors="replace")
            retry = reply.headers.get("retry-after")
            after = f" (Retry-After {retry})" if retry is not None else ""
            raise HttpError(f"HTTP {reply.status}{after}: {text[:300]}")
        tail = b""
        async for data in reply.content.iter_any():
            events, tail = split_events(tail + data)
            _take_events(out, events, chat)
        _take_events(out, [tail], chat)
    return out


def split_events(data: bytes) -> tuple[list[bytes], bytes]:
    """The complete SSE events of `data` (ended by a blank line) and the bytes after them."""
    *events, tail = data.replace(b"\r\n", b"\n").split(b"\n\n")
    return events, tail


def _take_events(out: Streamed, events: list[bytes], chat: bool) -> None:
    for event in events:
        event = event.strip()
        if event.startswith(b"data: ") and event != b"data: [DONE]":
            _take(out, orjson.loads(event[6:]), chat)


def _take(out: Streamed, event: dict, chat: bool) -> None:
    if "error" in event:
        raise HttpError(str(event["error"].get("message")))
    if event.get("usage"):
        out.prompt_tokens = event["usage"]["prompt_tokens"]
        out.completion_tokens = event["usage"]["completion_tokens"]
    for choice in event.get("choices", []):
        if is_token(choice, chat):
            out.arrivals.append(time.perf_counter())


def is_token(choice: dict, chat: bool) -> bool:
    """Whether a streamed choice brings tokens: every chunk does, with text or without (a token
    that ends inside a character has none yet), but a closing one that only gives the finish
    reason (memstep's front ends each choice so; vLLM's puts it on the last token's chunk)."""
    text = choice["delta"].get("content") if chat else choice.get("text")
    return bool(text) or choice.get("finish_reason") is None
