"""The client library against a real server: results, streams, aborts, errors, asyncio."""

from __future__ import annotations

import asyncio

import pytest

from memstep.api.client import AsyncClient, Client, ServerError
from memstep.cli.serve import ServerProcess
from memstep.events.log import read_log
from memstep.events.types import RequestAdded, RequestFinished, StepFinished
from memstep.events.wire import GenerateDelta, GenerateDone

LONG = {"max_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def record_path(tmp_path_factory):
    return tmp_path_factory.mktemp("log") / "serve.memlog"


@pytest.fixture(scope="module")
def server(record_path):
    args = ["--model", "random:tiny", "--num-threads", "1", "--record", str(record_path)]
    with ServerProcess(args) as proc:
        proc.wait_ready()
        yield proc


@pytest.fixture
def client(server):
    with Client(server.address, timeout=20) as c:
        yield c


def test_generate_returns_the_whole_completion(client):
    done = client.generate("abc", max_tokens=6, temperature=0.0)
    assert isinstance(done, GenerateDone) and done.finish_reason == "length"
    assert len(done.token_ids) == done.usage.completion_tokens == 6
    assert done.usage.prompt_tokens == 3  # random: models use a byte tokenizer
    assert (
        client.generate([ord(c) + 3 for c in "abc"], max_tokens=6, temperature=0.0).token_ids
        == done.token_ids
    )


def test_stream_yields_deltas_then_sets_the_result(client):
    stream = client.generate("abc", stream=True, max_tokens=5, temperature=0.8, seed=4)
    deltas = list(stream)
    assert all(isinstance(d, GenerateDelta) for d in deltas) and len(deltas) == 5
    assert stream.result is not None
    assert [t for d in deltas for t in d.token_ids] == stream.result.token_ids
    again = client.generate("abc", max_tokens=5, temperature=0.8, seed=4)
    assert (again.token_ids, again.text) == (stream.result.token_ids, stream.result.text)


def test_interleaved_streams_on_one_client_are_kept_apart(client):
    a = client.generate("first", stream=True, max_tokens=8, temperature=0.0)
    b = client.generate("second", stream=True, max_tokens=8, temperature=0.0)
    got_a, got_b = [], []
    for _ in range(8):
        got_b.append(next(b))
        got_a.append(next(a))
    assert {d.request_id for d in got_a} == {a.request_id}
    assert {d.request_id for d in got_b} == {b.request_id}
    assert list(a) == [] and list(b) == []
    assert a.result.token_ids == client.generate("first", max_tokens=8, temperature=0.0).token_ids
    assert b.result.token_ids == client.generate("second", max_tokens=8, temperature=0.0).token_ids


def test_closing_a_stream_aborts_its_request(client):
    with client.generate("abort me", stream=True, **LONG) as stream:
        next(stream)
    assert stream.result is not None and stream.result.finish_reason == "abort"
    assert 1 <= len(stream.result.token_ids) < 400
    stats = client.stats()
    assert stats.num_inflight == 0 and stats.finished["abort"] >= 1


def test_errors_raise_server_error_with_the_code(client):
    with pytest.raises(ServerError) as err:
        client.generate("abc", max_tokens=5, top_p=2.0, temperature=0.0)
    assert err.value.code == "invalid_request" and "top_p" in err.value.message
    with pytest.raises(ServerError) as err:
        client.abort("never-sent")
    assert err.value.code == "unknown_request"
    assert client.generate("still fine", max_tokens=2, temperature=0.0).finish_reason == "length"


def test_no_server_means_timeout():
    with Client("tcp://127.0.0.1:9", timeout=0.5) as lonely, pytest.raises(TimeoutError):
        lonely.health()


def test_health_and_stats_describe_the_server(client, server):
    client.generate(
        "abc", max_tokens=2, temperature=0.0
    )  # a step has run, whichever tests ran before
    health = client.health()
    assert health.status == "ok" and health.executor_alive
    assert (health.core_pid, health.executor_pid) == (
        server.info["core_pid"],
        server.info["executor_pid"],
    )
    assert health.vocab_size == 512 and health.max_model_len == 512 and health.protocol == 3
    stats = client.stats()
    assert stats.kv_pages_total > 0 and stats.kv_pages_used == 0
    assert stats.step > 0 and stats.step_kind == "no_spec"
    assert stats.memory is not None and stats.memory.live_bytes > 0


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(client):
    prompt = "a system prompt that two requests share: " + "x" * 20
    first = client.generate(prompt + " one", max_tokens=3, temperature=0.0)
    second = client.generate(prompt + " two", max_tokens=3, temperature=0.0)
    block = 16  # EngineConfig's block_size; random: models tokenize bytes
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == len(prompt) // block * block > 0
    stats = client.stats()
    assert stats.kv_pages_used == 0 and stats.kv_pages_cached > 0  # reusable, not held


def test_async_client_runs_requests_concurrently(server):
    async def main():
        async with AsyncClient(server.address, timeout=20) as ac:
            prompts = [f"prompt {i}" for i in range(12)]
            dones = await asyncio.gather(
                *(ac.generate(p, max_tokens=4, temperature=0.0) for p in prompts)
            )
            stream = await ac.generate("streamed", stream=True, **LONG)
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 3:
                    busy = await ac.stats()
                    await ac.abort(stream.request_id)
            health = await ac.health()
            return dones, stream.result, busy, health

    dones, aborted, busy, health = asyncio.run(asyncio.wait_for(main(), 60))
    assert [d.request_id for d in dones] == [f"a{i}" for i in range(12)]
    assert all(len(d.token_ids) == 4 for d in dones)
    assert aborted.finish_reason == "abort" and busy.num_inflight == 1
    assert health.status == "ok"


def test_serve_records_the_event_log(server, client, record_path):
    done = client.generate("recorded", max_tokens=3, temperature=0.0)
    _, records, _ = read_log(record_path)  # flushed every step, readable while serving
    added = [r for r in records if isinstance(r, RequestAdded)]
    finished = [r for r in records if isinstance(r, RequestFinished)]
    assert added[-1].prompt_token_ids == [ord(c) + 3 for c in "recorded"]
    assert (finished[-1].request_id, finished[-1].completion_tokens) == (added[-1].request_id, 3)
    steps = [r for r in records if isinstance(r, StepFinished)]
    rid = added[-1].request_id
    assert [t for step in steps for req, toks in step.sampled if req == rid for t in toks] == (
        done.token_ids
    )
