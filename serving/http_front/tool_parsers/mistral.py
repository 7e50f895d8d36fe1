"""Mistral calls: `[TOOL_CALLS]` and a JSON list, `[{"name": ..., "arguments": {...}}, ...]`
(the v3 tokenizers': Mistral 7B v0.3, Nemo, Mixtral 8x22B), or the newer
`[TOOL_CALLS]name[ARGS]{...}`, one marker a call (v11 tokenizers: Small 3.2, Devstral).

`[TOOL_CALLS]` is a special token of Mistral's tokenizers, and a reply's text leaves special
tokens out: a reply that opens with the bare list is read as calls too."""

from __future__ import annotations

import re

from memstep.serving.http_front.tool_call_stream import (
    NO,
    PARTIAL,
    TEXT,
    CallSyntax,
    Header,
    Tail,
    call_header,
    object_tail,
)
from memstep.serving.http_front.tool_parsers.parser import Call, ToolParser, call_json

OPEN, ARGS = "[TOOL_CALLS]", "[ARGS]"
NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]{1,64})(\[(A(R(G(S\]?)?)?)?)?)?")  # v11: name[ARGS]


def write(calls: list[Call]) -> str:
    return OPEN + "[" + ", ".join(call_json(c, "arguments") for c in calls) + "]"


def grammar(body: str, parallel: bool) -> str:
    more = ' (", " body)*' if parallel else ""
    return f'start: "{OPEN}[" body{more} "]"\n{body}'


def header(text: str) -> Header:
    """`[{"name": ..., "arguments": ` (the list's `[` before a first call), or `name[ARGS]`."""
    at = len(text) - len(text.lstrip())
    listed = text[at : at + 1] == "["
    head = call_header(text[at + 1 :] if listed else text)
    if isinstance(head, tuple):
        return head[0], head[1] + (at + 1 if listed else 0)
    if head == PARTIAL or listed:
        return head
    named = NAMED.match(text)
    if named is None:
        return NO
    if named.group(2) == ARGS:
        return named.group(1), named.end()
    return PARTIAL if named.end() == len(text) else NO


def tail(text: str) -> Tail:
    """A listed call's `}`, then `,` and the next or `]`; after `name[ARGS]{...}`, nothing."""
    at = len(text) - len(text.lstrip())
    if at == len(text):
        return None
    return object_tail(text, more=",", end="]") if text[at] == "}" else (0, TEXT)


def bare_start(body: str) -> int | str:
    """The bare list `[{` where the marker (a special token) was left out of the text."""
    if OPEN.startswith(body[: len(OPEN)]):
        return PARTIAL if len(body) < len(OPEN) else NO
    return 0 if body.startswith("[") else NO


PARSER = ToolParser(
    name="mistral",
    syntax=CallSyntax(
        open=OPEN, close="", header=header, tail=tail, bare_start=bare_start, bare_tail=tail
    ),
    markers=(OPEN, "[AVAILABLE_TOOLS]"),
    arguments_key="arguments",
    example=f'{OPEN}[{{"name": <function-name>, "arguments": <args-json-object>}}]',
    write=write,
    grammar=grammar,
)
