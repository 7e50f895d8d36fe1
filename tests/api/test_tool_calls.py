"""Tool-call parsing and streaming without a model: Hermes `<tool_call>` blocks and Llama-3.1
JSON calls parse into OpenAI's tool_calls, plain text stays content, and a streamed reply is
held back only while it may still be a call."""

from __future__ import annotations

import json

import pytest

from memstep.api.openai_protocol import OpenAIError, parse_chat
from memstep.api.tool_calls import CallStream, parse_calls

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "hi"}]


def test_hermes_blocks_and_llama_json_parse_into_tool_calls():
    text = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n' \
        '{"name": "g", "arguments": {}}\n</tool_call>'  # fmt: skip
    content, calls = parse_calls(text)
    assert content == "" and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["type"] == "function"
    _, llama = parse_calls('<|python_tag|>{"name": "f", "parameters": {"y": "z"}}')
    assert json.loads(llama[0]["function"]["arguments"]) == {"y": "z"}
    assert parse_calls("Just words.") == ("Just words.", [])
    assert parse_calls('{"not": "a call"}')[1] == []


def test_a_stream_is_held_only_while_it_may_be_a_call():
    plain = CallStream()
    assert plain.feed(" <to") == "" and plain.feed("day") == " <today"
    assert plain.feed(" more") == " more" and plain.finish() == ("", [])
    call = CallStream()
    for part in ["<tool", "_call>\n", '{"name": "f", "arguments": {}}', "\n</tool_call>"]:
        assert call.feed(part) == ""
    assert call.finish()[1][0]["function"]["name"] == "f"


def test_required_and_named_choices_force_a_grammar_and_bad_ones_are_400s():
    job = parse_chat({"model": "m", "messages": ASK, "tools": [TOOL],
                      "tool_choice": "required"}, "m")  # fmt: skip
    grammar = job.params[0]["guided_grammar"]
    assert '"const": "f"' in grammar and '("\\n" call)*' in grammar and job.calls_tools
    assert "<tools>" in job.prompts[0]["messages"][0]["content"]
    auto = parse_chat({"model": "m", "messages": ASK, "tools": [TOOL]}, "m")
    assert "guided_grammar" not in auto.params[0] and auto.calls_tools
    none = parse_chat({"model": "m", "messages": ASK, "tools": [TOOL], "tool_choice": "none"}, "m")
    assert not none.calls_tools and none.prompts[0]["messages"] == ASK
    for bad in ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                {"tool_choice": "required", "guided_regex": "a"}):  # fmt: skip
        with pytest.raises(OpenAIError) as err:
            parse_chat({"model": "m", "messages": ASK, "tools": [TOOL], **bad}, "m")
        assert err.value.status == 400
