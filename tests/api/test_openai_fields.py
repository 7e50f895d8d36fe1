"""Which request fields the OpenAI front takes: OpenAI's storage and billing fields (and vLLM's
`skip_special_tokens: true`, what the engine does anyway) are taken and change nothing, fields
it does not serve are refused by name, and others as unrecognized."""

from __future__ import annotations

import pytest

from memstep.api.openai_protocol import OpenAIError, parse_chat, parse_completion

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
