"""Tool calling in chat: OpenAI's `tools` and `tool_choice` in, `tool_calls` out.

The model's calls are read in its family's format (tool_parsers/: Hermes `<tool_call>`
blocks, Llama 3.1's bare JSON, Mistral's `[TOOL_CALLS]`), chosen once for the server
(`ToolFormat`). The tools reach the model through its chat template where the template renders
them (as `tools`, the way vLLM passes them), else as memstep's own system prompt (a `<tools>`
list and the format's call). `tool_choice="required"` or a named function is enforced by a
grammar (llguidance's Lark with an inline JSON schema per tool) that writes the format's call,
so its arguments always parse against the tool's schema.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from memstep.serving.http_front.tool_call_stream import split_reply
from memstep.serving.http_front.tool_parsers import DEFAULT, DEFAULT_FORMAT, ToolFormat
from memstep.serving.http_front.tool_parsers.parser import ToolParser, body_rule

# OpenAI's rule for a function's name (and dots, as namespaced tools use): a name is written into
# the prompt and the grammar, so one holding `</tool_call>` or 10 KB would break either
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions. Here are the "
    "available tools: <tools>\n{tools}\n</tools>\n{how}"
)
HERMES_HOW = (
    "For each function call return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> XML tags:\n{example}"
)
OTHER_HOW = "To call functions, reply with them in this form:\n{example}"


class ToolError(ValueError):
    """A `tools` or `tool_choice` the request cannot use; the message says why."""


@attrs.frozen
class Tools:
    """A chat request's tools, what it asked of them, and the format the model calls them in."""

    functions: tuple[dict[str, Any], ...]  # each {"name", "description"?, "parameters"?}
    choice: str  # "auto", "none", "required", or "function" (`named`)
    named: str = ""
    parallel: bool = True
    format: ToolFormat = DEFAULT_FORMAT

    @property
    def is_on(self) -> bool:
        return self.choice != "none" and bool(self.functions)

    @property
    def parser(self) -> ToolParser:
        return self.format.parser

    def listed(self) -> list[dict[str, Any]]:
        """The offered tools in OpenAI's form: the chat template's `tools`."""
        return [{"type": "function", "function": f} for f in self._offered()]

    def system_prompt(self) -> str:
        """memstep's own tools prompt, for a template that does not render tools."""
        how = HERMES_HOW if self.parser is DEFAULT else OTHER_HOW
        listed = "\n".join(json.dumps(t) for t in self.listed())
        return SYSTEM.format(tools=listed, how=how.format(example=self.parser.example))

    def _offered(self) -> list[dict[str, Any]]:
        if self.choice == "function":
            return [f for f in self.functions if f["name"] == self.named]
        return list(self.functions)

    def grammar(self) -> str | None:
        """The Lark grammar that forces a call in the format (`required`, a named function),
        else None."""
        if self.choice not in ("required", "function"):
            return None
        body = body_rule(self._offered(), self.parser.arguments_key)
        return self.parser.grammar(body, self.parallel and self.choice == "required")


def parse_tools(body: dict[str, Any], fmt: ToolFormat = DEFAULT_FORMAT) -> Tools | None:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`, checked; the calls to be
    made in `fmt`."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be a boolean")
    if tools is None:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools must be a list")
    functions = tuple(_function(t) for t in tools)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tools must have distinct names")
    if choice is None or choice in ("auto", "none", "required"):
        return Tools(functions, choice or "auto", "", parallel, fmt)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise ToolError(f"tool_choice names a function not in tools: {name!r}")
        return Tools(functions, "function", str(name), parallel, fmt)
    raise ToolError("tool_choice must be auto, none, required or a named function")


def _function(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ToolError("each tool must be {'type': 'function', 'function': {...}}")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolError("each tool's function needs a name")
    check_name(function["name"])
    if not isinstance(function.get("parameters", {}), dict):
        raise ToolError(f"{function['name']}: parameters must be a JSON schema object")
    keep = ("name", "description", "parameters")
    return {k: function[k] for k in keep if k in function}


def check_name(name: object) -> None:
    """A ToolError unless `name` is a function name OpenAI takes: 1 to 64 letters, digits,
    underscores, dashes or dots."""
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
        shown = repr(name)
        shown = shown if len(shown) <= 80 else f"{shown[:80]}... ({len(shown)} chars)"
        raise ToolError(
            f"a function name must be 1 to 64 letters, digits, '_', '-' or '.': {shown}"
        )


def parse_calls(text: str, parser: ToolParser = DEFAULT) -> tuple[str, list[dict[str, Any]]]:
    """(content left over, OpenAI tool_calls) of a whole reply in `parser`'s format, as its
    stream would accumulate (serving/http_front/tool_call_stream.py); no calls where none parse."""
    return split_reply(text, parser.syntax)


def calls_message(message: dict[str, Any], parser: ToolParser = DEFAULT) -> str:
    """An assistant message's `tool_calls` as the text the model would have written."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        check_name(function.get("name"))
        try:
            args = function.get("arguments", "{}")
            arguments = json.loads(args) if isinstance(args, str) else args
            json.dumps(arguments)
        except RecursionError:
            raise ToolError("a tool call's arguments are nested too deeply") from None
        calls.append((function["name"], arguments))
    return parser.write(calls) if calls else ""
