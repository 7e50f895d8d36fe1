"""Hermes calls (Qwen 2.5, Qwen 3, SmolLM2, Hermes models): each call a JSON object in a block,
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, anywhere in a reply, one block a
call. A reply that opens with Llama 3.1's bare JSON call is read too: memstep's own tools prompt
is Hermes', and small models tuned on mixed data answer it either way."""

from __future__ import annotations

from memstep.serving.http_front.tool_call_stream import (
    CallSyntax,
    block_tail,
    call_header,
    json_bare_start,
    object_tail,
)
from memstep.serving.http_front.tool_parsers.parser import Call, ToolParser, call_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def write(calls: list[Call]) -> str:
    return "\n".join(f"{OPEN}\n{call_json(c, 'arguments')}\n{CLOSE}" for c in calls)


def grammar(body: str, parallel: bool) -> str:
    more = ' ("\\n" call)*' if parallel else ""
    return f'start: call{more}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\n{body}'


PARSER = ToolParser(
    name="hermes",
    syntax=CallSyntax(
        open=OPEN,
        close=CLOSE,
        header=call_header,
        tail=block_tail(CLOSE),
        bare_start=json_bare_start(PYTHON_TAG),
        bare_tail=object_tail,
    ),
    markers=(OPEN,),
    arguments_key="arguments",
    example=f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}',
    write=write,
    grammar=grammar,
)
