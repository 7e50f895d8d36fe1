"""What a tool-call format is (`ToolParser`), and the pieces every format's grammar shares.

A format says how a model writes its calls: how they are read from its reply (`syntax`, for
http_front/tool_call_stream.py), written back into a conversation's history (`write`), forced by a
grammar when `tool_choice` is required or named (`grammar`), and how a chat template that
teaches the format is recognised (`markers`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs

from memstep.serving.http_front.tool_call_stream import CallSyntax

# a forced call's JSON written compactly: the grammar leaves the model no whitespace to wander in
JSON_COMPACT = {"whitespace_flexible": False}
Call = tuple[str, Any]  # a call's function name and its arguments (decoded JSON)


@attrs.frozen
class ToolParser:
    """One tool-call format, by vLLM's `--tool-call-parser` name."""

    name: str
    syntax: CallSyntax
    markers: tuple[str, ...]  # text that a chat template teaching this format holds
    arguments_key: str  # the key of a call's arguments: "arguments" (Hermes) or "parameters"
    example: str  # one call as the format writes it, for memstep's own tools prompt
    write: Callable[[list[Call]], str]  # calls as the model would have written them
    # the Lark grammar of one call (`%json` body, a rule named `body`) repeated where `parallel`
    grammar: Callable[[str, bool], str]


def body_rule(functions: list[dict[str, Any]], arguments_key: str) -> str:
    """The `body` rule: one JSON call of any of `functions`, its arguments under their schema."""
    calls = [call_schema(f, arguments_key) for f in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return f"body: %json {json.dumps({**schema, 'x-guidance': JSON_COMPACT})}\n"


def call_schema(function: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def call_json(call: Call, arguments_key: str) -> str:
    name, arguments = call
    return json.dumps({"name": name, arguments_key: arguments})
