"""Each tool-call format (serving/http_front/tool_parsers/) read whole and streamed, written
back into a history, and forced by its grammar; and the choice of one from the real chat templates
(chat_templates/ here) or `--tool-call-parser`. A reply read with another family's parser
is content: the choice is what makes a call a call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memstep.core.chat_template import ChatTemplate
from memstep.serving.http_front.openai_protocol import parse_chat
from memstep.serving.http_front.tool_call_stream import CallStream
from memstep.serving.http_front.tool_parsers import PARSERS, ToolFormat, UnknownParser, choose
from tests.serving.http_front.test_tool_calls import _accumulated

TEMPLATES = Path(__file__).parent / "chat_templates"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "hi"}]
# format -> [(reply, (content, [(name, arguments)]))]
CASES = {
    "hermes": [
        (
            '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
            ("", [("f", '{"x": 1}')]),
        ),
    ],
    "llama3_json": [
        ('{"name": "f", "parameters": {"x": 1}}', ("", [("f", '{"x": 1}')])),
        (
            '<|python_tag|>{"name": "f", "parameters": {"y": [1, {"z": "}"}]}}',
            ("", [("f", '{"y": [1, {"z": "}"}]}')]),
        ),
        (
            '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
            ("", [("f", '{"x": 1}'), ("g", "{}")]),
        ),
        ('Sure. <|python_tag|>{"name": "f", "parameters": {}}', ("Sure.", [("f", "{}")])),
        ('{"answer": 42}', ('{"answer": 42}', [])),
        ("plain words", ("plain words", [])),
    ],
    "mistral": [
        (
            '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]',
            ("", [("f", '{"x": 1}'), ("g", "{}")]),
        ),
        ('[{"name": "f", "arguments": {"a": "]"}}]', ("", [("f", '{"a": "]"}')])),
        (
            '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}',
            ("", [("f", '{"x": 1}'), ("g", "{}")]),
        ),
        (
            'Let me check.[TOOL_CALLS][{"name": "f", "arguments": {}}]',
            ("Let me check.", [("f", "{}")]),
        ),
        ('[TOOL_CALLS][{"arguments": {"a": 1}, "name": "h"}]', ("", [("h", '{"a": 1}')])),
        ("[1, 2, 3]", ("[1, 2, 3]", [])),
        ("[TOOL_CALLS] not json", ("[TOOL_CALLS] not json", [])),
        ("[INST] words", ("[INST] words", [])),
    ],
}
REPLIES = [(name, text, want) for name, cases in CASES.items() for text, want in cases]


def _read(parser_name: str, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    """The reply fed in pieces of `step` characters, accumulated as the openai SDK merges."""
    stream = CallStream(PARSERS[parser_name].syntax)
    deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i : i + step])]
    return _accumulated([*deltas, *stream.finish()])


@pytest.mark.parametrize(("parser", "text", "want"), REPLIES)
def test_each_format_reads_its_calls_whole_and_in_any_split(parser, text, want):
    for step in (1, 2, 3, 7, len(text)):
        assert _read(parser, text, step) == want, step


@pytest.mark.parametrize("reader", sorted(PARSERS))
def test_another_familys_call_is_content(reader):
    """The planted mistake: the wrong parser for a model reads its calls as plain text."""
    for writer, cases in CASES.items():
        if writer == reader or {writer, reader} == {"hermes", "llama3_json"}:
            continue  # hermes also reads a reply that opens with Llama's bare call
        for text, (_, calls) in cases:
            if calls and not text.startswith("["):
                assert _read(reader, text, len(text))[1] == [], (writer, text)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_calls_written_into_a_history_read_back(name):
    parser = PARSERS[name]
    calls = [("f", {"x": [1, "}"]}), ("g", {})]
    text = parser.write(calls)
    read = _read(name, text, 5)[1]
    assert [(n, json.loads(a)) for n, a in read] == calls


# template -> (the format it teaches, whether it renders tools)
PICKED = {
    "qwen2": ("hermes", True),
    "qwen3": ("hermes", True),
    "llama": ("llama3_json", True),
    "mistral": ("mistral", True),
    "gemma3": ("hermes", False),
    "phi3": ("hermes", False),
    "mixtral": ("hermes", False),
}


@pytest.mark.parametrize("template", sorted(PICKED))
def test_the_format_is_the_templates_and_the_flag_overrides_it(template):
    source = (TEMPLATES / f"{template}.jinja").read_text()
    compiled = ChatTemplate(source, "<s>", "</s>")
    renders = compiled.renders_tools()
    fmt = choose(None, source, renders)
    assert (fmt.parser.name, fmt.in_template) == PICKED[template]
    assert compiled.takes_system_turn() == (template != "mixtral")
    forced = choose("mistral", source, renders)
    assert forced.parser.name == "mistral" and forced.in_template == renders


def test_a_template_that_names_a_format_but_ignores_tools_keeps_memsteps_prompt():
    source = "{% for m in messages %}<tool_call>{{ m.content }}{% endfor %}"
    assert not ChatTemplate(source, "").renders_tools()
    assert choose(None, source, False) == ToolFormat(PARSERS["hermes"], False)
    with pytest.raises(UnknownParser, match="hermes"):
        choose("pythonic", source, False)


def test_a_template_that_renders_tools_gets_them_and_the_grammar_writes_its_format():
    fmt = ToolFormat(PARSERS["mistral"], in_template=True)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
        *ASK,
    ]
    body = {"model": "m", "messages": history, "tools": [TOOL], "tool_choice": "required"}
    job = parse_chat(body, "m", fmt)
    source = job.prompts[0]
    assert source["chat_template_kwargs"]["tools"] == [TOOL]
    assert [m["role"] for m in source["messages"]] == ["user", "assistant", "tool", "user"]
    assert source["messages"][1]["content"] == '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]'
    assert source["messages"][2]["content"] == "sunny"  # the template wraps a result itself
    assert 'start: "[TOOL_CALLS][" body (", " body)* "]"' in job.params[0]["guided_grammar"]
    own = parse_chat(body, "m", ToolFormat(PARSERS["llama3_json"], in_template=False))
    prompt = own.prompts[0]["messages"][0]
    assert prompt["role"] == "system" and '"parameters": <args-json-object>' in prompt["content"]
    assert "chat_template_kwargs" not in own.prompts[0]
    assert own.params[0]["guided_grammar"].startswith('start: body ("; " body)*')
    bare = parse_chat(body | {"messages": ASK}, "m", ToolFormat(system_turn=False))
    (first,) = bare.prompts[0]["messages"]  # a template without a system turn: the user's
    assert first["role"] == "user" and first["content"].endswith("</tool_call>\n\nhi")
