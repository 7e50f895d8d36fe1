"""Llama 3.1 / 3.2 / 3.3 calls: a reply that is a bare JSON call,
`{"name": ..., "parameters": {...}}`, after an optional `<|python_tag|>` (which may also open a
call later in a reply), several separated by `;` as vLLM's `llama3_json` reads them."""

from __future__ import annotations

import functools

from memstep.serving.http_front.tool_call_stream import (
    CallSyntax,
    call_header,
    json_bare_start,
    object_tail,
)
from memstep.serving.http_front.tool_parsers.parser import Call, ToolParser, call_json

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


def write(calls: list[Call]) -> str:
    return f"{SEPARATOR} ".join(call_json(c, "parameters") for c in calls)


def grammar(body: str, parallel: bool) -> str:
    more = f' ("{SEPARATOR} " body)*' if parallel else ""
    return f"start: body{more}\n{body}"


_tail = functools.partial(object_tail, more=SEPARATOR)

PARSER = ToolParser(
    name="llama3_json",
    syntax=CallSyntax(
        open=PYTHON_TAG,
        close="",
        header=call_header,
        tail=_tail,
        bare_start=json_bare_start(PYTHON_TAG),
        bare_tail=_tail,
    ),
    # Llama 3.1's template names the tag; 3.2's and 3.3's only the call's JSON shape
    markers=(PYTHON_TAG, '"parameters": '),
    arguments_key="parameters",
    example='{"name": <function-name>, "parameters": <args-json-object>}',
    write=write,
    grammar=grammar,
)
