"""The tool-call formats memstep reads, by vLLM's `--tool-call-parser` names, and the choice of
one for a model: the flag, else the one its chat template teaches.

A template that renders `tools` itself (Qwen's, Llama 3.1's, Mistral's) is given the request's
tools, as vLLM gives them; one that does not (SmolLM2's, Gemma 3's, Phi-3's) gets memstep's own
tools prompt in a system turn, in the chosen format (Hermes unless the flag says otherwise).
"""

from __future__ import annotations

import attrs

from memstep.serving.http_front.tool_parsers import hermes, llama3_json, mistral
from memstep.serving.http_front.tool_parsers.parser import ToolParser

PARSERS: dict[str, ToolParser] = {p.PARSER.name: p.PARSER for p in (hermes, llama3_json, mistral)}
DEFAULT = hermes.PARSER


class UnknownParser(ValueError):
    """A `--tool-call-parser` name memstep has no parser of."""


@attrs.frozen
class ToolFormat:
    """What a server does with tools: the format its model writes calls in, and whether the
    chat template renders the tools (else memstep's own prompt carries them)."""

    parser: ToolParser = DEFAULT
    in_template: bool = False
    system_turn: bool = True  # the template takes a system turn (else the first turn holds
    # memstep's tools prompt)

    def as_flags(self) -> list[str]:
        """This format as the HTTP front's command-line flags."""
        flags = ["--tool-call-parser", self.parser.name]
        flags += ["--tools-in-template"] if self.in_template else []
        return flags + ([] if self.system_turn else ["--no-system-turn"])


DEFAULT_FORMAT = ToolFormat()


def parser_named(name: str) -> ToolParser:
    if name not in PARSERS:
        raise UnknownParser(f"unknown tool-call parser {name!r}: choose from {sorted(PARSERS)}")
    return PARSERS[name]


def from_template(source: str | None) -> ToolParser | None:
    """The format a chat template's text teaches (the first whose markers it holds), if any."""
    for parser in PARSERS.values():
        if source and any(marker in source for marker in parser.markers):
            return parser
    return None


def choose(
    name: str | None, template: str | None, renders_tools: bool, system_turn: bool = True
) -> ToolFormat:
    """The server's format: `name` (the flag) where given, else the template's. The tools go to
    the template where it renders them, and either the flag chose the format or the template
    teaches one memstep reads (a template that writes calls otherwise keeps memstep's prompt)."""
    taught = from_template(template)
    parser = parser_named(name) if name is not None else taught or DEFAULT
    in_template = renders_tools and (name is not None or taught is not None)
    return ToolFormat(parser, in_template, system_turn)
