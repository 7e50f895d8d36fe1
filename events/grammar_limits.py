"""The bounds a structured-output constraint must keep before anything compiles it.

The grammar engine (llguidance) is native code: a schema or grammar deep or wide enough
overflows its stack, panics its matcher or compiles for minutes.  These checks are pure Python,
linear in the constraint's bytes and never recursive past their own bound, so a hostile
constraint costs its request a 400 (`ConstraintTooLarge`) before any compile; docs/limits.md
states each bound.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_CONSTRAINT_BYTES = 256 * 1024  # a schema's, a regex's or a grammar's text
MAX_SCHEMA_DEPTH = 128  # JSON containers nested, each local $ref followed where it points
MAX_SCHEMA_PROPERTIES = 1000  # property names, summed over every object of the schema
MAX_CHOICES = 4096  # strings of a guided choice
MAX_CHOICE_BYTES = 256 * 1024  # their bytes together
MAX_GRAMMAR_RULES = 2000  # rule definitions of a GBNF or Lark grammar
MAX_REGEX_BYTES = 16 * 1024

_RULE = re.compile(r"(?m)^\s*[A-Za-z_][\w.-]*\s*(::=|:)")
_EMBEDDED = re.compile(r"%json\s*")


class ConstraintTooLarge(ValueError):
    """A constraint past one of this module's bounds; the message names the bound."""


def check_limits(kind: str, text: str) -> None:
    """Raise ConstraintTooLarge where the constraint (core/grammar.py's kind and text) is past
    a bound."""
    _bound(len(text.encode()), MAX_CONSTRAINT_BYTES, "bytes of constraint text")
    if kind == "json":
        check_schema(text)
    elif kind == "choice":
        choices = json.loads(text)
        _bound(len(choices), MAX_CHOICES, "choices")
        _bound(sum(len(c.encode()) for c in choices), MAX_CHOICE_BYTES, "bytes of choices")
    elif kind == "regex":
        _bound(len(text.encode()), MAX_REGEX_BYTES, "bytes of regex")
    elif kind == "grammar":
        _bound(len(_RULE.findall(text)), MAX_GRAMMAR_RULES, "grammar rules")
        for schema in _embedded_schemas(text):
            _check_schema_value(schema)


def check_schema(text: str) -> None:
    """A JSON schema's depth ($refs expanded) and property count within their bounds."""
    try:
        schema = json.loads(text)
    except RecursionError:
        raise ConstraintTooLarge(f"schema nested deeper than {MAX_SCHEMA_DEPTH}") from None
    except ValueError:
        return  # not JSON: grammar_of says so with the parser's message
    _check_schema_value(schema)


def _check_schema_value(schema: Any) -> None:
    _bound(_num_properties(schema), MAX_SCHEMA_PROPERTIES, "schema properties")
    _Depth(schema).check(schema)


def _embedded_schemas(text: str) -> list[Any]:
    """The JSON schemas a Lark grammar embeds (`%json {...}`: a forced tool call's
    parameters are one)."""
    decoder, found = json.JSONDecoder(), []
    for match in _EMBEDDED.finditer(text):
        try:
            found.append(decoder.raw_decode(text, match.end())[0])
        except RecursionError:
            raise ConstraintTooLarge(f"schema nested deeper than {MAX_SCHEMA_DEPTH}") from None
        except ValueError:
            continue  # not JSON: the grammar's compile says so
    return found


def _bound(value: int, limit: int, what: str) -> None:
    if value > limit:
        raise ConstraintTooLarge(f"{value} {what}, more than the limit of {limit}")


def _num_properties(schema: Any) -> int:
    """Property names of every object in the schema, found without recursion."""
    count, todo = 0, [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                count += len(props)
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return count


class _Depth:
    """The longest path of nested containers through a schema, each local `$ref` ("#/...")
    followed to its target: what the grammar engine's recursion descends.  Each node's depth
    is computed once (a DAG of shared definitions stays linear); a `$ref` back into the path
    (a recursive schema, which the engine expands lazily) adds nothing."""

    def __init__(self, root: Any):
        self.root = root
        self.memo: dict[int, int] = {}
        self.path: set[int] = set()
        self.nodes: list[Any] = []  # the containers on the path, outermost first

    def check(self, node: Any) -> None:
        self.depth(node, 0)

    def depth(self, node: Any, level: int) -> int:
        if level > MAX_SCHEMA_DEPTH:
            raise ConstraintTooLarge(
                f"schema nested deeper than {MAX_SCHEMA_DEPTH} levels ($refs followed)"
            )
        if not isinstance(node, (dict, list)):
            return 0
        key = id(node)
        if key in self.memo:
            known = self.memo[key]
            _bound(level + known, MAX_SCHEMA_DEPTH, "levels of schema nesting ($refs followed)")
            return known
        if key in self.path:
            return 0
        self.path.add(key)
        self.nodes.append(node)
        children = list(node.values()) if isinstance(node, dict) else list(node)
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            children.append(self.target(node["$ref"]))
        deepest = max((self.depth(child, level + 1) for child in children), default=0)
        self.nodes.pop()
        self.path.discard(key)
        self.memo[key] = deepest + 1
        return deepest + 1

    def target(self, ref: str) -> Any:
        """The node a local JSON pointer names, from the root or else from the nearest
        container on the path that holds it (a schema embedded in another, as a tool's
        parameters are: counted either way); None for a remote or broken one."""
        if not ref.startswith("#"):
            return None
        for base in [self.root, *reversed(self.nodes)]:
            found = _pointer(base, ref)
            if found is not None:
                return found
        return None


def _pointer(node: Any, ref: str) -> Any:
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def limits_error(kind: str, text: str) -> str:
    """Why the constraint is past a bound (or malformed JSON), or "": no compile, no worker."""
    try:
        check_limits(kind, text)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return ""
