"""A request's structured-output constraint, as the grammar engine (llguidance) reads it.

A constraint is recorded as the user gave it (a JSON schema, a regex, choices, an EBNF/Lark
grammar, or "any JSON object"), in `SamplingParams`; `grammar_of` turns it into llguidance's
grammar text and `grammar_error` checks that text compiles, both cached per distinct
constraint, so that a request whose grammar cannot compile is refused at the door with the
reason, and the executor compiles each distinct grammar once.  No torch here: the core checks,
the executor (executors/runtime/guide.py) matches.
"""

from __future__ import annotations

import json
from functools import lru_cache

KINDS = ("json", "json_object", "regex", "choice", "grammar")
ANY_OBJECT = '{"type": "object"}'
# compact JSON (no free whitespace): fewer tokens, and a model cannot pad forever with spaces
JSON_OPTIONS = {"whitespace_flexible": False}


@lru_cache(maxsize=512)
def grammar_of(kind: str, text: str) -> str:
    """llguidance's grammar for a constraint; raises ValueError on a malformed one."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if kind == "json":
        return LLMatcher.grammar_from_json_schema(json.loads(text), defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        choices = json.loads(text)
        return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, choices)))
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(any_to_lark(text))
    raise ValueError(f"unknown constraint kind {kind!r}")


@lru_cache(maxsize=512)
def grammar_error(kind: str, text: str) -> str:
    """Why the constraint cannot compile, or "" when it can."""
    from llguidance import LLMatcher

    try:
        grammar = grammar_of(kind, text)
    except (ValueError, TypeError) as exc:
        return str(exc) or type(exc).__name__
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else ""
