"""The HTTP front of a real `memstep serve` with SmolLM2, through the official `openai` SDK,
raw SSE over curl, and `/metrics` read by prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from memstep.api.client import Client
from memstep.cli.serve import ServerProcess

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server():
    args = ["--model", "smollm2", "--dtype", "float32", "--num-threads", "1"]
    with ServerProcess(args, http=True) as proc:
        proc.wait_ready(timeout=300)
        yield proc


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0)


def test_sdk_chat_and_completions_say_paris(sdk):
    chat = sdk.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0, max_tokens=16
    )
    assert "Paris" in chat.choices[0].message.content
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 16 or chat.choices[0].finish_reason == "stop"
    done = sdk.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=4)
    assert "Paris" in done.choices[0].text and done.usage.prompt_tokens > 0


def test_sdk_streams_say_paris_and_count_usage(sdk):
    stream = sdk.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_async_sdk_streaming_and_not_say_paris(server):
    async def ask() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="x")
        whole = await client.chat.completions.create(
            model="smollm2", messages=QUESTION, temperature=0, max_tokens=16
        )
        stream = await client.completions.create(
            model="smollm2", prompt=PROMPT, temperature=0, max_tokens=4, stream=True
        )
        parts = [chunk.choices[0].text async for chunk in stream]
        await client.close()
        return whole.choices[0].message.content, "".join(parts)

    chat_text, streamed = asyncio.run(ask())
    assert "Paris" in chat_text and "Paris" in streamed


def test_n_and_seed_give_distinct_choices_that_repeat(sdk):
    def ask(seed: int) -> list[str]:
        reply = sdk.completions.create(
            model="smollm2", prompt=PROMPT, n=2, seed=seed, temperature=1.0, max_tokens=12
        )
        assert [c.index for c in reply.choices] == [0, 1]
        return [c.text for c in reply.choices]

    first = ask(7)
    assert first == ask(7)  # a seed makes the whole reply reproducible
    assert first[0] != first[1]  # while the choices are distinct samples
    assert ask(8) != first


def test_chat_logprobs_are_the_models(sdk):
    reply = sdk.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0.0
        assert token.top_logprobs[0].token == token.token  # greedy picks the most likely
        assert token.logprob == pytest.approx(tops[0])


def test_completion_logprobs_and_stop(sdk):
    plain = sdk.completions.create(
        model="smollm2", prompt=PROMPT, temperature=0, max_tokens=8, logprobs=2
    )
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert all(len(top) <= 3 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    # each holds the chosen token, as OpenAI's and vLLM's do (3 entries where it is not top 2)
    assert all(lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))
    text = plain.choices[0].text
    word = text.split()[1]
    cut = sdk.completions.create(
        model="smollm2", prompt=PROMPT, temperature=0, max_tokens=8, stop=[word]
    )
    assert cut.choices[0].text == text[: text.index(word)]
    assert cut.choices[0].finish_reason == "stop"


def test_curl_gets_sse_chunks_ending_in_done(server):
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    body["stream"] = True
    out = subprocess.run(
        [
            "curl",
            "-sN",
            server.http_url + "/v1/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(body),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    events = [e for e in out.stdout.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "Paris" in "".join(c["choices"][0]["text"] for c in chunks)


def test_bad_requests_get_openai_error_objects(server, sdk):
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model="smollm2", prompt=PROMPT, temperature=-1)
    assert "temperature" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError):  # a stream is refused before its first byte
        sdk.completions.create(model="smollm2", prompt=PROMPT, temperature=-1, stream=True)
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="gpt-4", prompt=PROMPT)
    r = httpx.post(server.http_url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.http_url + "/v1/completions", json={"prompt": "x", "foo": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "foo"
    assert sdk.models.list().data[0].id == "smollm2"
    assert httpx.get(server.http_url + "/health").status_code == 200


def test_metrics_parse_and_move_as_requests_run(server, sdk):
    before = _metrics(server.http_url)
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True}
    with httpx.stream(
        "POST", server.http_url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the connection
        assert next(lines).startswith("data: ")
        during = _metrics(server.http_url)
        # leaving the block closes the connection mid-stream: the request is aborted
    after = _wait_for(server, lambda m: m[("memstep:request_success_total", "abort")] >= 1)
    sdk.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True}
    )
    after = _metrics(server.http_url)
    assert during[("memstep:num_requests_running", "")] == 1
    assert during[("memstep:kv_cache_usage_perc", "")] > 0
    assert after[("memstep:num_requests_running", "")] == 0
    grew = [
        "memstep:generation_tokens_total",
        "memstep:prompt_tokens_total",
        "memstep:e2e_request_latency_seconds_count",
        "memstep:time_to_first_token_seconds_count",
        "memstep:inter_token_latency_seconds_count",
        "memstep:request_queue_time_seconds_count",
    ]
    for name in grew:
        assert after[(name, "")] > before.get((name, ""), 0), name
    assert after[("memstep:request_success_total", "length")] >= 1
    assert sum(v for (n, _), v in after.items() if n == "memstep:steps_total") > 0
    assert sum(v for (n, _), v in after.items() if n == "memstep:step_transitions_total") > 0
    for name in ("memstep:memory_live_bytes", "memstep:memory_reserved_bytes"):
        assert after[(name, "")] > 0
    assert after[("memstep:allocator_segments", "")] > 0
    assert after[("memstep:arena_claimed_bytes", "")] >= 0
    assert during[("memstep:kv_pages_used", "")] > after[("memstep:kv_pages_used", "")]
    assert after[("memstep:host_rss_bytes", "core")] > 0
    assert after[("memstep:host_rss_bytes", "executor")] > after[("memstep:host_rss_bytes", "core")]
    assert ("memstep:leak_reports_total", "") in after
    assert ("memstep:num_preemptions_total", "") in after


def _metrics(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            label = next(iter(s.labels.values()), "") if len(s.labels) == 1 else ""
            if "le" not in s.labels:
                out[(s.name, label)] = s.value
    return out


def _wait_for(server, cond, timeout: float = 30.0) -> dict[tuple[str, str], float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server.http_url)
        if cond(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


# --- a tiny random model: the API key, and an executor killed under load -------------------


@pytest.fixture(scope="module")
def tiny():
    # no executor restarts: a killed executor is final, and the server stays up a minute to say so
    args = ["--model", "random:tiny", "--num-threads", "1", "--api-key", "sesame"]
    args += ["--max-executor-restarts", "0", "--dead-exit-s", "60"]
    with ServerProcess(args, http=True) as proc:
        proc.wait_ready()
        yield proc


def test_api_key_is_required_on_v1(tiny):
    url = tiny.http_url
    body = {"model": "random:tiny", "prompt": "abc", "max_tokens": 2}
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    wrong = {"Authorization": "Bearer open"}
    assert httpx.post(url + "/v1/completions", json=body, headers=wrong).status_code == 401
    right = {"Authorization": "Bearer sesame"}
    assert httpx.post(url + "/v1/completions", json=body, headers=right).status_code == 200


@pytest.mark.parametrize("chat", [False, True])
def test_every_token_gets_its_chunk_also_one_without_text(tiny, chat):
    """A token that adds no text yet (a byte of an unfinished UTF-8 character, from random:tiny's
    byte tokenizer) still gets its chunk, as vLLM's server sends one: a client times each token,
    and the first chunk comes with the first token.  The check fires: a front that holds such
    tokens back sends fewer chunks than tokens (and a reply of them only its last, at its end)."""
    body = {"model": "random:tiny", "max_tokens": 24, "temperature": 1.0, "seed": 3}
    body |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    body |= {"messages": [{"role": "user", "content": "abc"}]} if chat else {"prompt": "abc"}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    auth = {"Authorization": "Bearer sesame"}
    with httpx.stream("POST", tiny.http_url + path, json=body, headers=auth, timeout=60) as reply:
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line[:7] == "data: {"]
    tokens = [c for e in events for c in e["choices"] if c["finish_reason"] is None]
    if chat:  # the role-only first chunk comes before any token
        assert tokens.pop(0)["delta"] == {"role": "assistant", "content": ""}
    texts = [c["delta"]["content"] if chat else c["text"] for c in tokens]
    assert len(tokens) == events[-1]["usage"]["completion_tokens"] == 24
    assert "" in texts and any(texts), texts  # tokens without text, and with


def test_a_killed_executor_turns_health_503_and_requests_into_openai_errors(tiny):
    sdk = openai.OpenAI(base_url=tiny.http_url + "/v1", api_key="sesame", max_retries=0)
    assert httpx.get(tiny.http_url + "/health").status_code == 200
    with Client(tiny.address, timeout=20) as zmq_client:
        os.kill(tiny.info["executor_pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while zmq_client.health().status == "ok" and time.monotonic() < deadline:
            time.sleep(0.2)
    health = httpx.get(tiny.http_url + "/health")
    assert health.status_code == 503 and health.json()["status"] != "ok"
    with pytest.raises(openai.APIStatusError) as err:
        sdk.completions.create(model="random:tiny", prompt="abc", max_tokens=2)
    assert err.value.status_code == 503
    assert err.value.body["code"] == "executor_dead"


def test_logit_bias_min_tokens_and_stop_token_ids_over_http(server, sdk):
    """OpenAI's logit_bias (ids as strings) through the SDK, vLLM's min_tokens and
    stop_token_ids through extra_body; the same request over ZMQ gives the same tokens."""
    with Client(server.address, timeout=60) as zmq_client:
        free = zmq_client.generate(PROMPT, temperature=0.0, max_tokens=12)
        forced = free.token_ids[1]
        pushed = zmq_client.generate(
            PROMPT, temperature=0.0, max_tokens=4, logit_bias={str(forced): 100}
        )
    assert pushed.token_ids == [forced] * 4
    biased = sdk.completions.create(
        model="smollm2",
        prompt=PROMPT,
        temperature=0,
        max_tokens=4,
        logit_bias={str(forced): 100},
    )
    assert biased.choices[0].text == pushed.text
    stop_id = free.token_ids[2]
    cut = sdk.completions.create(
        model="smollm2",
        prompt=PROMPT,
        temperature=0,
        max_tokens=12,
        extra_body={"stop_token_ids": [stop_id]},
    )
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == 3
    held = sdk.completions.create(
        model="smollm2",
        prompt=PROMPT,
        temperature=0,
        max_tokens=12,
        extra_body={"stop_token_ids": [stop_id], "min_tokens": 4},
    )
    assert held.usage.completion_tokens > 3
    for bad, says in (({"x": 1}, "not a token id"), ({str(forced): 500}, "in [-100, 100]")):
        with pytest.raises(openai.BadRequestError, match=re.escape(says)):
            sdk.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, logit_bias=bad)


def test_tokenize_and_detokenize_as_vllm_s(server):
    """/tokenize reads a prompt or chat messages as the completions do (its count is their
    usage's prompt_tokens); /detokenize gives the ids' text back; bad input is a 400."""
    url = server.http_url
    raw = httpx.post(url + "/tokenize", json={"model": "smollm2", "prompt": PROMPT}).json()
    assert raw["count"] == len(raw["tokens"]) > 0 and raw["max_model_len"] >= 2048
    back = httpx.post(url + "/detokenize", json={"model": "smollm2", "tokens": raw["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": PROMPT}
    chat = httpx.post(url + "/tokenize", json={"messages": QUESTION}).json()
    done = httpx.post(
        url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1}
    ).json()
    assert chat["count"] == done["usage"]["prompt_tokens"]
    with Client(server.address, timeout=30) as zmq_client:
        assert zmq_client.tokenize(messages=QUESTION).token_ids == chat["tokens"]
    for path, body, status, says in (
        ("/detokenize", {"tokens": [10**9]}, 400, "outside the vocabulary"),
        ("/detokenize", {"tokens": "abc"}, 400, "list of token ids"),
        ("/tokenize", {"prompt": "a", "messages": QUESTION}, 400, "exactly one"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "does not exist"),
    ):
        bad = httpx.post(url + path, json=body)
        assert bad.status_code == status and says in bad.json()["error"]["message"], bad.text


def test_completion_echo_scores_the_prompt_as_lm_eval_asks(sdk, server):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, one new token): the text
    and tokens begin with the prompt's, each prompt token scored given those before it (the
    first with nothing), then the new token as without echo; over ZMQ, `prompt_logprobs`."""
    body = dict(model="smollm2", temperature=0, max_tokens=1, logprobs=1)
    done = sdk.completions.create(prompt=PROMPT, echo=True, **body)
    choice, n = done.choices[0], done.usage.prompt_tokens
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and lp.text_offset[-1] == len(PROMPT)
    plain = sdk.completions.create(prompt=PROMPT, **body).choices[0]
    assert lp.token_logprobs[-1] == pytest.approx(plain.logprobs.token_logprobs[0], abs=1e-5)
    assert choice.text == PROMPT + plain.text
    with Client(server.address) as client:
        ids = client.tokenize(PROMPT).token_ids
        zmq = client.generate(ids, temperature=0.0, max_tokens=1, prompt_logprobs=1)
        # the last prompt token's score: the logprob of that token where a prompt one token
        # shorter is answered
        cut = client.generate(ids[:-1], temperature=0.0, max_tokens=1, logprobs=20)
    assert [e[0] for e in zmq.prompt_logprobs] == ids and zmq.prompt_logprobs[0][2] is None
    assert [e[2] for e in zmq.prompt_logprobs[1:]] == pytest.approx(lp.token_logprobs[1:n])
    alternatives = {tid: logprob for tid, _, logprob in cut.logprobs[0][3]}
    assert zmq.prompt_logprobs[-1][2] == pytest.approx(alternatives[ids[-1]], abs=1e-4)
    as_ids = sdk.completions.create(prompt=ids, echo=True, **body).choices[0]
    assert as_ids.text == choice.text  # a prompt of ids echoes its tokens' texts
    one = sdk.completions.create(prompt=ids[:1], echo=True, **body).choices[0].logprobs
    assert one.tokens[0] == lp.tokens[0] and one.token_logprobs[0] is None and len(one.tokens) == 2
    unlogged = sdk.completions.create(prompt=PROMPT, echo=True, model="smollm2", max_tokens=2)
    assert unlogged.choices[0].text.startswith(PROMPT) and unlogged.choices[0].logprobs is None
    streamed = list(sdk.completions.create(prompt=PROMPT, echo=True, stream=True, **body))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    first = streamed[0].choices[0].logprobs
    assert tokens == lp.tokens and first.token_logprobs[0] is None
    assert first.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1 : len(tokens)])


def test_echo_with_max_tokens_0_gives_the_prompt_alone(sdk):
    """vLLM's echo with max_tokens 0 (how eval harnesses score a prompt alone): the prompt's
    text and scores, no reply token counted; streamed the same; without echo refused."""
    body = dict(model="smollm2", temperature=0, logprobs=1, echo=True)
    scored = sdk.completions.create(prompt=PROMPT, max_tokens=1, **body)
    alone = sdk.completions.create(prompt=PROMPT, max_tokens=0, **body)
    n = alone.usage.prompt_tokens
    assert alone.choices[0].text == PROMPT and alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.tokens == scored.choices[0].logprobs.tokens[:n]
    assert alone.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        scored.choices[0].logprobs.token_logprobs[1:n]
    )
    streamed = list(sdk.completions.create(prompt=PROMPT, max_tokens=0, stream=True, **body))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT
    with pytest.raises(openai.BadRequestError, match="max_tokens 0 needs echo"):
        sdk.completions.create(prompt=PROMPT, model="smollm2", max_tokens=0)


def test_vllm_prompt_logprobs_field_scores_and_ranks_each_prompt_token(sdk, server):
    """vLLM's `prompt_logprobs` (completions: on each choice; chat: beside the choices): None
    for the first token, then each prompt token's id -> {logprob, rank, decoded_token} and the
    top N ranked 1..N; the token's rank is 1 exactly where it is the top one, its place in the
    top N where it is among them, and past N where not. Refused with stream."""
    url = server.http_url + "/v1"
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 3}
    answer = httpx.post(url + "/completions", json=body, timeout=60).json()
    scores = answer["choices"][0]["prompt_logprobs"]
    with Client(server.address) as client:
        ids = client.tokenize(PROMPT).token_ids
    assert len(scores) == len(ids) == answer["usage"]["prompt_tokens"] and scores[0] is None
    ranked_first = 0
    for token, entry in zip(ids[1:], scores[1:], strict=True):
        own = entry[str(token)]
        by_rank = sorted(entry.values(), key=lambda v: v["rank"])
        # the token among the top 3 is one of them (ids are keys); else a fourth, ranked after
        assert [v["rank"] for v in by_rank] == [1, 2, 3] + (
            [own["rank"]] if own["rank"] > 3 else []
        )
        values = [v["logprob"] for v in by_rank]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        ranked_first += own["rank"] == 1
    assert ranked_first >= 1  # a prompt of plain English: some tokens the model's first choice
    chat = {"model": "smollm2", "messages": QUESTION, "max_tokens": 1, "prompt_logprobs": 0}
    done = httpx.post(url + "/chat/completions", json=chat, timeout=60).json()
    assert len(done["prompt_logprobs"]) == done["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in done["prompt_logprobs"][1:])  # the token's own only
    for wrong, says in (
        ({"stream": True}, "not available with stream"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be"),
    ):
        bad = httpx.post(url + "/completions", json=body | wrong, timeout=60)
        assert bad.status_code == 400 and says in bad.json()["error"]["message"], bad.text


def test_sdk_retrieves_the_model_and_an_unknown_one_is_openais_404(sdk):
    card = sdk.models.retrieve("smollm2")
    assert card.id == "smollm2" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        sdk.models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found" and "gpt-4" in err.value.body["message"]


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server, chat):
    """guidellm's and aiperf's stream_options: every chunk carries the usage so far (vLLM's
    continuous_usage_stats); its last equals the closing usage chunk's, and the prompt count
    equals a plain request's."""
    body = {"model": "smollm2", "max_tokens": 6, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    body |= {"messages": QUESTION} if chat else {"prompt": PROMPT}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.stream("POST", server.http_url + path, json=body, timeout=60) as reply:
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line[:7] == "data: {"]
    usages = [e["usage"] for e in events]
    assert all(u is not None for u in usages)
    done = usages.pop()  # the closing chunk: no choices, the whole usage
    assert events[-1]["choices"] == [] and done["completion_tokens"] == 6
    plain = httpx.post(
        server.http_url + path, json=body | {"stream": False, "stream_options": None}
    )
    assert done == plain.json()["usage"]
    assert usages[-1] == {
        k: done[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[0] == (0 if chat else 1)


def test_chat_template_kwargs_reach_the_core_template(sdk):
    """vLLM's chat_template_kwargs travel to the core's template: a variable SmolLM2's template
    does not read changes nothing; one the engine sets itself is refused there, by name."""
    kw = dict(model="smollm2", messages=QUESTION, temperature=0, max_tokens=6)
    plain = sdk.chat.completions.create(**kw)
    thinking = sdk.chat.completions.create(
        **kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert thinking.choices[0].message.content == plain.choices[0].message.content
    assert thinking.usage.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="may not set add_generation_prompt"):
        sdk.chat.completions.create(
            **kw, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}
        )


def test_tokenizer_info_and_tokenize_as_lm_eval_reads_them(server):
    """vLLM's /tokenizer_info, and /tokenize as lm-eval's remote tokenizer calls it
    (`add_special_tokens: false`): the end-of-text token's text tokenizes to the id the engine
    stops on, and the chat template is the one the engine renders."""
    info = httpx.get(server.http_url + "/tokenizer_info").json()
    assert (info["bos_token"], info["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert info["model_max_length"] > 0 and "im_start" in info["chat_template"]
    tokenize = server.http_url + "/tokenize"
    eos = httpx.post(tokenize, json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [2]  # SmolLM2's <|im_end|>
    # vLLM's add_special_tokens true: SmolLM2's tokenizer adds none around a text
    added = httpx.post(tokenize, json={"prompt": "x y", "add_special_tokens": True})
    plain = httpx.post(tokenize, json={"prompt": "x y"})
    assert added.status_code == 200 and added.json()["tokens"] == plain.json()["tokens"]
    for route, ask in (
        ("completions", {"prompt": "x y"}),
        ("chat/completions", {"messages": QUESTION}),
    ):
        body = {"model": "smollm2", **ask, "max_tokens": 1, "add_special_tokens": True}
        taken = httpx.post(f"{server.http_url}/v1/{route}", json=body)
        assert taken.status_code == 200, taken.text


def test_a_request_without_sampling_values_takes_the_models_defaults(sdk):
    """`--generation-config auto` (the default): SmolLM2's card, temperature 0.2 and top-p 0.9,
    fill what a request leaves out; its own values win (a bare 1.0 samples otherwise)."""

    def text(**given) -> str:
        kw = dict(model="smollm2", prompt="Once upon a time", max_tokens=24, seed=11)
        return sdk.completions.create(**kw, **given).choices[0].text

    bare = text()
    assert bare == text(temperature=0.2, top_p=0.9)
    assert bare != text(temperature=1.0, top_p=1.0)
