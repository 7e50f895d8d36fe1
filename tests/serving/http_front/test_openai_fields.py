"""Which request fields the OpenAI front takes: OpenAI's storage and billing fields (and vLLM's
`skip_special_tokens: true`, what the engine does anyway) are taken and change nothing, fields
it does not serve are refused by name, and others as unrecognized."""

from __future__ import annotations

import pytest

from memstep.serving.http_front.openai_protocol import (
    OpenAIError,
    format_logprobs,
    parse_chat,
    parse_completion,
    parse_tokenize,
)

ASK = [{"role": "user", "content": "hi"}]


def test_storage_and_billing_fields_are_taken_and_change_nothing():
    plain = parse_chat({"model": "m", "messages": ASK}, "m")
    extra = {"store": False, "metadata": {"team": "a"}, "service_tier": "auto"}
    extra["skip_special_tokens"] = True  # vLLM's default: how every text here is made
    assert parse_chat({"model": "m", "messages": ASK, **extra}, "m") == plain
    assert (
        parse_completion({"model": "m", "prompt": "x", "store": True}, "m").params[0]
        == (parse_completion({"model": "m", "prompt": "x"}, "m").params[0])
    )


@pytest.mark.parametrize(
    "parse, body, says",
    [
        (parse_completion, {"prompt": "x", "suffix": "y"}, "suffix is not supported"),
        (parse_chat, {"messages": ASK, "functions": []}, "functions is not supported"),
        (parse_chat, {"messages": ASK, "reasoning_effort": "low"}, "reasoning_effort is not"),
        (parse_chat, {"messages": ASK, "bogus": 1}, "Unrecognized request argument supplied"),
        (parse_chat, {"messages": ASK, "skip_special_tokens": False}, "false is not supported"),
        (parse_completion, {"prompt": "x", "skip_special_tokens": 1}, "must be a boolean"),
    ],
)
def test_fields_not_served_are_refused_by_name(parse, body, says):
    with pytest.raises(OpenAIError, match=says) as refused:
        parse({"model": "m", **body}, "m")
    assert refused.value.status == 400


@pytest.mark.parametrize(
    "parse, body",
    [
        (parse_completion, {"prompt": "x", "use_beam_search": False, "length_penalty": 1.0}),
        (parse_completion, {"prompt": "x", "add_special_tokens": False, "priority": 0}),
        (parse_chat, {"messages": ASK, "add_generation_prompt": True, "bad_words": []}),
        (parse_chat, {"messages": ASK, "continue_final_message": False, "cache_salt": None}),
    ],
)
def test_vllm_fields_at_values_that_change_nothing_are_taken(parse, body):
    plain = {"prompt": "x"} if "prompt" in body else {"messages": ASK}
    assert parse({"model": "m", **body}, "m").params == parse({"model": "m", **plain}, "m").params


@pytest.mark.parametrize(
    "parse, body, says",
    [
        (parse_completion, {"prompt": "x", "use_beam_search": True}, "beam search"),
        (parse_completion, {"prompt": "x", "priority": 1}, "priority 1 is not supported"),
        (parse_chat, {"messages": ASK, "add_generation_prompt": False}, "generation prompt"),
        (parse_chat, {"messages": ASK, "chat_template": "{{ x }}"}, "--chat-template"),
        (parse_chat, {"messages": ASK, "cache_salt": "a"}, "prefix cache is shared"),
        (parse_chat, {"messages": ASK, "request_id": "a"}, "X-Request-Id"),
        (parse_chat, {"messages": ASK, "priority": True}, "priority True"),
        (parse_chat, {"messages": ASK, "echo": True}, "not prefixed with the last message"),
    ],
)
def test_vllm_fields_asking_for_what_is_not_done_are_refused_with_the_reason(parse, body, says):
    name = next(k for k in body if k not in ("prompt", "messages"))
    with pytest.raises(OpenAIError, match=says) as refused:
        parse({"model": "m", **body}, "m")
    assert refused.value.status == 400 and refused.value.param == name


def test_more_than_four_stop_strings_and_max_completion_tokens_on_completions():
    stops = [f"s{i}" for i in range(9)]  # lm-eval's tasks may give more than OpenAI's 4
    job = parse_completion({"prompt": "x", "stop": stops, "max_completion_tokens": 7}, "m")
    assert job.params[0]["stop"] == stops and job.params[0]["max_tokens"] == 7
    with pytest.raises(OpenAIError, match="list of strings"):
        parse_completion({"prompt": "x", "stop": ["a", 3]}, "m")
    with pytest.raises(OpenAIError, match="at most 256"):
        parse_completion({"prompt": "x", "stop": ["a"] * 257}, "m")


def test_continuous_usage_stats_is_taken_with_include_usage_as_vllm():
    def job(options):
        body = {"prompt": "x", "stream": True, "stream_options": options}
        return parse_completion(body, "m")

    assert job({"include_usage": True, "continuous_usage_stats": True}).continuous_usage
    assert not job({"include_usage": False, "continuous_usage_stats": True}).continuous_usage
    assert not job({"include_usage": True}).continuous_usage
    with pytest.raises(OpenAIError, match="must be a boolean"):
        job({"include_usage": True, "continuous_usage_stats": "yes"})
    with pytest.raises(OpenAIError, match="takes only include_usage and continuous"):
        job({"include_usage": True, "every_chunk": True})


def test_legacy_top_logprobs_hold_the_chosen_token():
    job = parse_completion({"prompt": "x", "logprobs": 2}, "m")
    tokens = [[5, "a", -0.5, [[5, "a", -0.5], [6, "b", -1.0]]]]
    tokens.append([7, "c", -3.0, [[5, "a", -0.4], [6, "b", -0.9]]])  # sampled outside the top 2
    top = format_logprobs(job, tokens, 0)["top_logprobs"]
    assert top == [{"a": -0.5, "b": -1.0}, {"a": -0.4, "b": -0.9, "c": -3.0}]


def test_add_special_tokens_is_taken_on_both_routes_with_vllms_defaults():
    """vLLM's meaning: the tokenizer's own special tokens around the prompt's ids (the core adds
    them: serving/core_answers.py); absent or null, vLLM's default: on for a completion's text
    (a Llama or Gemma tokenizer's BOS), off for a chat and its template; anything else, a 400.
    /tokenize follows the same defaults for a prompt and for messages."""
    routes = ((parse_completion, {"prompt": "x"}, True), (parse_chat, {"messages": ASK}, False))
    for parse, plain, default in routes:
        for value, added in ((True, True), (False, False), (None, default)):
            body = {"model": "m", **plain, "add_special_tokens": value}
            prompts = parse(body, "m").prompts
            assert [p.get("add_special_tokens", False) for p in prompts] == [added], (parse, value)
        assert parse({"model": "m", **plain}, "m").prompts == prompts
        with pytest.raises(OpenAIError, match="must be a boolean"):
            parse({"model": "m", **plain, "add_special_tokens": "yes"}, "m")
    assert parse_tokenize({"prompt": "x"}, "m").add_special_tokens
    assert not parse_tokenize({"messages": ASK}, "m").add_special_tokens
    assert not parse_tokenize({"prompt": "x", "add_special_tokens": False}, "m").add_special_tokens
