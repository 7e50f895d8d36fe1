"""GBNF (llama.cpp's grammar format) to Lark, in time linear in the rules.

llguidance's own converter (`llguidance.gbnf_to_lark`) finds which rules are terminals by
sweeping every rule until nothing changes: one sweep per link of a rule chain, so its time is
quadratic in the rules (a chain of a few thousand rules took seconds).  This module keeps its
parser and output and finds the same terminals with a work list: a rule becomes terminal once
every rule it refers to has (never the start rule), each reference counted once.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from llguidance.gbnf_to_lark import (
    ASTNode,
    GrammarParser,
    RuleNode,
    RuleRefNode,
    is_lark_syntax,
)


class GrammarSyntaxError(ValueError):
    """A grammar the converter cannot read; the message is short and says where."""


def any_to_lark(text: str) -> str:
    """The grammar in Lark syntax (GBNF converted; Lark as given)."""
    if is_lark_syntax(text):
        return text
    return gbnf_to_lark(text)


def gbnf_to_lark(text: str) -> str:
    try:
        rules = GrammarParser().parse(text)
        _resolve(rules)
    except RecursionError:
        raise GrammarSyntaxError("grammar nested too deeply") from None
    except Exception as exc:  # the parser raises plain Exceptions with a position
        raise GrammarSyntaxError(f"grammar syntax: {str(exc)[:300]}") from None
    out = ["%llguidance {}\n\n"]
    prev_nl = True
    for rule in sorted(rules.values(), key=lambda r: r.order):
        s = str(rule)
        if not prev_nl and "\n" in s:
            out.append("\n")
        out.append(s + "\n")
        prev_nl = "\n" in s
        if prev_nl:
            out.append("\n")
    return "".join(out)


def _nodes(node: ASTNode) -> Iterator[ASTNode]:
    todo = list(node.children())
    while todo:
        child = todo.pop()
        yield child
        todo.extend(child.children())


def _resolve(rules: dict[str, RuleNode]) -> None:
    """llguidance's `resolve`: simplify, link references, name `root` `start`, mark the
    terminal rules (upper-case names) and rename to Lark's conventions."""
    for i, rule in enumerate(rules.values()):
        rule.order = i
        rule.alternatives = rule.alternatives.simplify()
    referrers: dict[str, set[str]] = {name: set() for name in rules}
    pending: dict[str, int] = {}
    for name, rule in rules.items():
        targets = set()
        for node in _nodes(rule):
            if isinstance(node, RuleRefNode):
                if node.name not in rules:
                    raise GrammarSyntaxError(f"rule '{node.name}' not found")
                node.target = rules[node.name]
                targets.add(node.name)
        pending[name] = len(targets)
        for target in targets:
            referrers[target].add(name)
    if "root" not in rules:
        raise GrammarSyntaxError("no 'root' rule")
    _mark_terminals(rules, referrers, pending)
    _rename(rules, rules["root"], "start")
    for rule in list(rules.values()):
        new = re.sub(r"([a-z])([A-Z])", r"\1_\2", rule.name.replace("-", "_"))
        new = new.upper() if rule.rule_is_terminal else new.lower()
        if rule.name != new:
            _rename(rules, rule, new)


def _mark_terminals(
    rules: dict[str, RuleNode], referrers: dict[str, set[str]], pending: dict[str, int]
) -> None:
    todo = [name for name, n in pending.items() if n == 0 and name != "root"]
    while todo:
        name = todo.pop()
        rules[name].rule_is_terminal = True
        for referrer in referrers[name]:
            pending[referrer] -= 1
            if pending[referrer] == 0 and referrer != "root":
                todo.append(referrer)


def _rename(rules: dict[str, Any], rule: RuleNode, name: str) -> None:
    if name in rules:
        raise GrammarSyntaxError(f"rule '{name}' already exists")
    del rules[rule.name]
    rule.name = name
    rules[name] = rule
