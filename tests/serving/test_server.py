"""The API server with the real default model: 64 concurrent streams, and disconnects."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import zmq

from memstep.api.client import AsyncClient, Client
from memstep.cli.serve import ServerProcess
from memstep.core.sampling_params import SamplingParams
from memstep.events import codec
from memstep.events.wire import GenerateRequest

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is a hash table?",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "How do I start learning the guitar?",
    "Why is the sky blue?",
]
NUM_CLIENTS = 64
MAX_TOKENS = 8
STYLES = ["", "Answer briefly. ", "Be precise. ", "In one sentence: ", "Quickly: ", "Please: "]
STYLES += ["Explain simply. ", "Kindly: "]


@pytest.fixture(scope="module")
def server():
    args = ["--model", "smollm2", "--dtype", "float32", "--quantization", "none"]
    args += ["--max-num-seqs", str(NUM_CLIENTS)]
    args += ["--num-threads", "1"]  # one thread per process: robust when the CPU is shared
    with ServerProcess(args) as proc:
        yield proc  # each test waits for it: the first computes its reference meanwhile


def request(i: int, tok) -> tuple[dict, list[int]]:
    """Client i's prompt, given three ways (chat messages, text, token ids), and its token ids."""
    text = STYLES[i // len(QUESTIONS)] + QUESTIONS[i % len(QUESTIONS)]
    if i % 8 == 0:  # one in eight sends chat messages: the server templates them (longer)
        messages = [{"role": "user", "content": text}]
        return {"messages": messages}, tok.encode_chat(messages)
    ids = tok.encode(text)
    return ({"prompt": text} if i % 2 else {"prompt": ids}), ids


def test_64_concurrent_streaming_clients_get_the_in_process_greedy_completions(server, smol_engine):
    requests = [request(i, smol_engine.tokenizer) for i in range(NUM_CLIENTS)]
    prompts = [ids for _, ids in requests]
    assert len(set(map(tuple, prompts))) == NUM_CLIENTS
    reference = _one_thread(
        smol_engine.generate, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    )
    server.wait_ready(timeout=300)
    sources = [source for source, _ in requests]
    results = asyncio.run(asyncio.wait_for(_stream_all(server.address, sources), 300))
    for i, (deltas, done) in enumerate(results):
        ref = reference[i]
        assert done.token_ids == ref.token_ids, f"client {i}: {done.text!r} != {ref.text!r}"
        assert done.text == ref.text and done.finish_reason == ref.finish_reason
        assert [t for d in deltas for t in d.token_ids] == done.token_ids
        assert "".join(d.text for d in deltas) == done.text
        assert done.usage.prompt_tokens == len(prompts[i])
        assert done.usage.completion_tokens == len(done.token_ids) > 0
        times = done.timing.token_times_s
        assert len(times) == len(done.token_ids) and times == sorted(times)
        assert 0 < done.timing.ttft_s == times[0] <= done.timing.e2e_s


def _one_thread(fn, *args):
    """Run `fn` on one torch thread: two threads crawl when another process holds a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


async def _stream_all(address: str, sources: list[dict]):
    clients = [AsyncClient(address, timeout=120) for _ in sources]

    async def one(client: AsyncClient, source: dict):
        stream = await client.generate(
            **source, stream=True, max_tokens=MAX_TOKENS, temperature=0.0
        )
        deltas = [delta async for delta in stream]
        return deltas, stream.result

    try:
        return await asyncio.gather(*map(one, clients, sources))
    finally:
        for client in clients:
            await client.close()


def _wait_idle(client: Client, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if stats.num_inflight == 0 and stats.num_running + stats.num_waiting == 0:
            return stats
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {stats}"
        time.sleep(0.1)


def test_clients_that_disconnect_mid_stream_leave_no_pages(server):
    server.wait_ready(timeout=300)
    long = {"max_tokens": 1500, "ignore_eos": True}
    with Client(server.address, timeout=60) as watcher:
        before = _wait_idle(watcher, 60).finished.get("disconnect", 0)
        streamers = [Client(server.address, timeout=60) for _ in range(6)]
        streams = [c.generate(f"Story {i}:", stream=True, **long) for i, c in enumerate(streamers)]
        waiters = [zmq.Context.instance().socket(zmq.DEALER) for _ in range(2)]
        for i, sock in enumerate(waiters):  # not streaming: found by the Keepalive probe
            sock.connect(server.address)
            sock.send(codec.encode(GenerateRequest(f"w{i}", f"Poem {i}:", params=long)))
        for stream in streams:
            next(stream)
            next(stream)
        busy = watcher.stats()
        assert busy.num_inflight == 8 and busy.kv_pages_used > 0, busy
        for client in streamers:
            client.close()
        for sock in waiters:
            sock.close(0)
        idle = _wait_idle(watcher, 20)
    assert idle.kv_pages_used == 0
    assert idle.finished.get("disconnect", 0) - before == 8
