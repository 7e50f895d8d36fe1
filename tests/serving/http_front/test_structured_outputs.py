"""Structured outputs and tool calls over HTTP: a real `memstep serve` with SmolLM2, through the
`openai` SDK; each constrained text is checked against its constraint (jsonschema, a regex, the
choices), and constraints that cannot compile are 400s that leave the server serving."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from memstep.cli.serve import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "grid": {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "maxItems": 2,
            },
            "maxItems": 2,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["color", "grid", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Describe a color and a small grid of digits as JSON."}]
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--model", "smollm2", "--max-num-seqs", "20"], http=True) as proc:
        proc.wait_ready(timeout=300)
        yield proc


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0)


def _schema_reply(sdk, seed: int):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    return sdk.chat.completions.create(
        model="smollm2",
        messages=ASK,
        temperature=1.0,
        seed=seed,
        max_tokens=60,
        response_format=fmt,
    )


def test_json_schema_validates_in_20_of_20_samples(sdk):
    with ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(lambda s: _schema_reply(sdk, s), range(20)))
    texts = [r.choices[0].message.content for r in replies]
    assert all(r.choices[0].finish_reason == "stop" for r in replies), texts
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1, "temperature 1.0 with 20 seeds gave one text"


def test_regex_choice_grammar_and_json_object(sdk):
    date = sdk.completions.create(
        model="smollm2",
        prompt="The date today is",
        max_tokens=16,
        temperature=0,
        extra_body={"guided_regex": DATE},
    )
    assert re.fullmatch(DATE, date.choices[0].text), date.choices[0].text
    choice = sdk.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no", "maybe"]},
    )
    assert choice.choices[0].message.content in ("yes", "no", "maybe")
    gbnf = 'root ::= "The answer is " digit digit "."\ndigit ::= [0-9]'
    grammar = sdk.completions.create(
        model="smollm2",
        prompt="Q: 6 times 7? A:",
        max_tokens=12,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": gbnf}},
    )
    assert re.fullmatch(r"The answer is \d\d\.", grammar.choices[0].text)
    short = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    obj = sdk.chat.completions.create(
        model="smollm2",
        messages=short,
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = obj.choices[0].message.content
    assert obj.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


def _check_call(call) -> None:
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_call_validates_whole_and_streamed(sdk):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="smollm2", messages=ask, tools=[WEATHER], tool_choice="required")
    reply = sdk.chat.completions.create(**kw, max_tokens=100, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call)
    chunks = list(sdk.chat.completions.create(**kw, max_tokens=100, temperature=0, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    first = deltas[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert len([d for d in deltas if d.index == 0]) > 2, "the arguments came in one delta"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the openai SDK's own accumulation of the stream gives the non-streamed calls
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(c)
    streamed = state.get_final_completion().choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_tool_streams_send_content_as_it_comes_with_its_logprobs(sdk):
    ask = [{"role": "user", "content": "Say hello to Ada in one sentence."}]
    kw = dict(
        model="smollm2",
        messages=ask,
        tools=[WEATHER],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    whole = sdk.chat.completions.create(**kw).choices[0]
    assert not whole.message.tool_calls and whole.message.content
    chunks = list(sdk.chat.completions.create(**kw, stream=True))
    texts = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(texts) > 3, texts  # not held to the end
    assert "".join(texts) == whole.message.content
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [
        (t.token, t.logprob) for t in whole.logprobs.content
    ]


def test_named_tool_choice_and_none(sdk):
    ask = [{"role": "user", "content": "Weather in Rome, in fahrenheit?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = sdk.chat.completions.create(
        model="smollm2",
        messages=ask,
        tools=[WEATHER],
        tool_choice=named,
        parallel_tool_calls=False,
        max_tokens=100,
        temperature=0,
    )
    assert len(reply.choices[0].message.tool_calls) == 1
    _check_call(reply.choices[0].message.tool_calls[0])
    plain = sdk.chat.completions.create(
        model="smollm2", messages=ask, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert not plain.choices[0].message.tool_calls and plain.choices[0].message.content


@pytest.mark.parametrize(
    "extra, reason",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                }
            },
            "objectx",
        ),
        ({"extra_body": {"guided_grammar": "start: missing_rule"}}, "missing_rule"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "unclosed"),
    ],
)
def test_uncompilable_constraint_is_a_400_and_serving_goes_on(sdk, extra, reason):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, **extra)
    assert err.value.status_code == 400 and reason in str(err.value)
    ok = sdk.completions.create(model="smollm2", prompt="Hello", max_tokens=2, temperature=0)
    assert ok.choices[0].text


@pytest.mark.parametrize("max_tokens", [2, 9, 20])  # in the marker, the name, the arguments
def test_a_forced_call_cut_by_length_is_the_calls_begun_and_no_markup(sdk, max_tokens):
    """A forced call that max_tokens cuts (in its marker, its name, its arguments) has one
    shape, whole or streamed: finish_reason length, content null, and the calls whose name
    was complete, their arguments as far as written; the check fires where the markup held
    back at the cut comes out as content (as it did before)."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="smollm2", messages=ask, tools=[WEATHER], tool_choice="required")
    whole = sdk.chat.completions.create(**kw, max_tokens=max_tokens, temperature=0).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(name == "get_weather" for name, _ in calls)
    stream = sdk.chat.completions.create(**kw, max_tokens=max_tokens, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "length"
    got: dict[int, list[str]] = {}  # the SDK's own accumulator refuses a reply cut by length
    for delta in [d for c in chunks for d in c.choices[0].delta.tool_calls or []]:
        name, arguments = got.setdefault(delta.index, ["", ""])
        got[delta.index] = [
            name + (delta.function.name or ""),
            arguments + delta.function.arguments,
        ]
    assert [tuple(got[i]) for i in sorted(got)] == calls
    assert bool(calls) == (max_tokens == 20)  # greedy: the name is complete by token 20
