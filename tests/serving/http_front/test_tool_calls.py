"""Tool-call parsing and streaming without a model: Hermes `<tool_call>` blocks and Llama-3.1
JSON calls parse into OpenAI's tool_calls, plain text stays content, a streamed reply is held
back only while it may still start a call, calls stream as OpenAI's deltas, and any split of a
reply accumulates to the whole reply's parse."""

from __future__ import annotations

import json

import pytest

from memstep.serving.http_front.openai_protocol import OpenAIError, parse_chat
from memstep.serving.http_front.tool_call_stream import CallStream, split_reply
from memstep.serving.http_front.tool_calls import parse_calls
from memstep.serving.http_front.tool_parsers import hermes

HERMES = hermes.PARSER.syntax

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "hi"}]


def test_hermes_blocks_and_llama_json_parse_into_tool_calls():
    text = (
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
        '{"name": "g", "arguments": {}}\n</tool_call>'
    )
    content, calls = parse_calls(text)
    assert content == "" and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["type"] == "function"
    _, llama = parse_calls('<|python_tag|>{"name": "f", "parameters": {"y": "z"}}')
    assert json.loads(llama[0]["function"]["arguments"]) == {"y": "z"}
    assert parse_calls("Just words.") == ("Just words.", [])
    assert parse_calls('{"not": "a call"}')[1] == []


def _fed(text: str, step: int) -> list[dict]:
    stream = CallStream(HERMES)
    out = [d for i in range(0, len(text), step) for d in stream.feed(text[i : i + step])]
    return out + stream.finish()


def _accumulated(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) per call, merged by index as the openai SDK merges."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for part in delta.get("tool_calls", []):
            name, args = calls.get(part["index"], ("", ""))
            fn = part["function"]
            calls[part["index"]] = (name + fn.get("name", ""), args + fn["arguments"])
    return content, [calls[i] for i in sorted(calls)]


REPLIES = [
    '<tool_call>\n{"name": "f", "arguments": {"x": 1, "s": "a}\\"b"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
    'Let me look.\n<tool_call>\n{"name":"f","arguments":{"city":"Paris"}}\n</tool_call>',
    '<|python_tag|>{"name": "f", "parameters": {"y": [1, {"z": "}"}]}}',
    '<tool_call>{"arguments": {"a": 1}, "name": "h"}</tool_call>',
    "<tool_call>not json</tool_call> then text",
    '<tool_call>\n{"name": "f", "argu',
    '{"not": "a call"}',
    " <today is <tool_call nearly> a call",
]


@pytest.mark.parametrize("text", REPLIES)
def test_any_split_of_a_reply_accumulates_to_the_whole_reply(text):
    content, calls = parse_calls(text)
    whole = (content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    for step in (1, 2, 3, 5, 11, len(text)):
        assert _accumulated(_fed(text, step)) == whole, step


def test_calls_stream_as_openai_sends_them():
    text = '<tool_call>\n{"name": "f", "arguments": {"city": "Paris", "n": [1, 2]}}\n</tool_call>'
    deltas = _fed(text, 4)
    first = deltas[0]["tool_calls"][0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "f", "arguments": ""}
    fragments = [d["tool_calls"][0] for d in deltas[1:]]
    assert len(fragments) > 3 and all(set(f) == {"index", "function"} for f in fragments)
    args = "".join(f["function"]["arguments"] for f in fragments)
    assert json.loads(args) == {"city": "Paris", "n": [1, 2]}
    assert args == '{"city": "Paris", "n": [1, 2]}'  # the model's text, not re-serialized


def test_content_streams_at_once_and_only_a_possible_marker_waits():
    stream = CallStream(HERMES)
    assert stream.feed("Hello") == [{"content": "Hello"}]
    assert stream.feed(" there <tool") == [{"content": " there"}]  # " <tool" may be a marker
    assert stream.feed("box>") == [{"content": " <toolbox>"}]
    assert stream.feed("\n") == []  # whitespace waits: it may precede a call
    assert stream.feed("<tool_call>") == []
    assert stream.feed('{"name": "f", ') == []
    assert stream.feed('"arguments": {')[0]["tool_calls"][0]["function"]["name"] == "f"
    start = CallStream(HERMES)
    assert start.feed("{") == [] and start.feed('"answer"') == [{"content": '{"answer"'}]
    assert start.finish() == []
    tag = CallStream(HERMES)  # a Llama-3.1 call may open with its tag
    assert tag.feed("<|python") == [] and tag.feed("_tag|>") == []


def test_required_and_named_choices_force_a_grammar_and_bad_ones_are_400s():
    job = parse_chat(
        {"model": "m", "messages": ASK, "tools": [TOOL], "tool_choice": "required"}, "m"
    )
    grammar = job.params[0]["guided_grammar"]
    assert '"const": "f"' in grammar and '("\\n" call)*' in grammar and job.calls_tools
    assert "<tools>" in job.prompts[0]["messages"][0]["content"]
    auto = parse_chat({"model": "m", "messages": ASK, "tools": [TOOL]}, "m")
    assert "guided_grammar" not in auto.params[0] and auto.calls_tools
    none = parse_chat({"model": "m", "messages": ASK, "tools": [TOOL], "tool_choice": "none"}, "m")
    assert not none.calls_tools and none.prompts[0]["messages"] == ASK
    for bad in (
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tool_choice": "required", "guided_regex": "a"},
    ):
        with pytest.raises(OpenAIError) as err:
            parse_chat({"model": "m", "messages": ASK, "tools": [TOOL], **bad}, "m")
        assert err.value.status == 400


@pytest.mark.parametrize("name", ["", "n" * 10_240, "f</tool_call>", "a b", "x\n", 7])
def test_a_tool_name_outside_openais_rule_is_a_400(name):
    """A name goes into the prompt and the grammar: empty, 10 KB or holding `</tool_call>`
    would break them.  The same rule for a call in the history."""
    tool = {"type": "function", "function": {"name": name}}
    with pytest.raises(OpenAIError) as err:
        parse_chat({"model": "m", "messages": ASK, "tools": [tool]}, "m")
    assert err.value.status == 400 and "name" in str(err.value)
    call = {"id": "c", "type": "function", "function": {"name": name, "arguments": "{}"}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}, *ASK]
    with pytest.raises(OpenAIError) as err:
        parse_chat({"model": "m", "messages": history}, "m")
    assert err.value.status == 400 and "function name must be" in str(err.value)


def test_names_openai_takes_are_taken():
    for name in ("f", "get_weather", "ns.tool-2", "x" * 64):
        tool = {"type": "function", "function": {"name": name}}
        assert parse_chat({"model": "m", "messages": ASK, "tools": [tool]}, "m").calls_tools


@pytest.mark.parametrize(
    "arguments",
    ["[" * 100_000 + "]" * 100_000, '{"a": ' + "7" * 5_000 + "}", "{not json"],
    ids=["nested", "long-int", "not-json"],
)
def test_call_arguments_that_do_not_parse_are_a_400(arguments):
    """Nested past the recursion limit (a RecursionError was a 500), an integer past Python's
    4,300 digits, or not JSON at all."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}, *ASK]
    with pytest.raises(OpenAIError) as err:
        parse_chat({"model": "m", "messages": history}, "m")
    assert err.value.status == 400 and "tool_calls" in str(err.value)


def test_a_forced_call_cut_short_drops_held_markup_and_keeps_a_named_call():
    """`cut` (a forced call that max_tokens ended) gives no content: a marker or header held at
    the cut is dropped, a call whose name was complete keeps its arguments as written; without
    `cut` the same text is content (what a reply that is not forced shows)."""
    assert split_reply("<tool_", HERMES, cut=True) == ("", [])
    assert split_reply('<tool_call>\n{"name": "f', HERMES, cut=True) == ("", [])
    assert split_reply('<tool_call>\n{"name": "f', HERMES, cut=False)[0].startswith("<tool_call>")
    _, calls = split_reply('<tool_call>\n{"name": "f", "arguments": {"x": ', HERMES, cut=True)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("f", '{"x": ')]
