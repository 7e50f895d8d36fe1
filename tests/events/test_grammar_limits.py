"""The bounds a constraint must keep before anything compiles it (events/grammar_limits.py), and
the GBNF converter that is linear in its rules (core/gbnf.py): each attack of issue 55 is
refused in milliseconds with the bound it broke, and what a real schema or grammar uses passes."""

from __future__ import annotations

import json
import time

import pytest
from llguidance.gbnf_to_lark import gbnf_to_lark as llguidance_gbnf_to_lark

from memstep.core import gbnf
from memstep.core.grammar import compile_error, limits_error
from memstep.events.grammar_limits import MAX_SCHEMA_DEPTH, ConstraintTooLarge, check_limits


def ref_chain(depth: int, pointer: str = "#/$defs/") -> dict:
    """A schema whose every level is a `$ref` to the next: a 1,000-deep one is ~60 KB."""
    defs = {
        f"a{i}": {"type": "array", "items": {"$ref": f"{pointer}a{i + 1}"}} for i in range(depth)
    }
    defs[f"a{depth}"] = {"type": "string"}
    return {"$ref": f"{pointer}a0", "$defs": defs}


def gbnf_chain(rules: int) -> str:
    body = "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(rules))
    return f'root ::= r0\n{body}r{rules} ::= "b"\n'


def forced_call(parameters: dict) -> str:
    """A forced tool call's grammar as serving/http_front/tool_calls.py makes it: the parameters
    embedded."""
    schema = {"type": "object", "properties": {"name": {"const": "f"}, "arguments": parameters}}
    return (
        f'start: call\ncall: "<tool_call>" body "</tool_call>"\nbody: %json {json.dumps(schema)}\n'
    )


@pytest.mark.parametrize(
    "kind, text, bound",
    [
        ("json", json.dumps(ref_chain(1000)), "nested deeper"),
        ("grammar", forced_call(ref_chain(1000, "#/properties/arguments/$defs/")), "nested deeper"),
        ("grammar", forced_call(ref_chain(1000)), "nested deeper"),  # resolved where it sits
        ("json", "[" * 150_000 + "]" * 150_000, "bytes of constraint text"),
        ("json", "[" * 5_000 + "]" * 5_000, "nested deeper"),
        ("json", json.dumps({"properties": {f"p{i}": {} for i in range(1001)}}), "properties"),
        ("choice", json.dumps([f"c{i}" for i in range(100_000)]), "bytes of constraint text"),
        ("choice", json.dumps([str(i % 10) for i in range(5000)]), "choices"),
        ("grammar", gbnf_chain(10_000), "grammar rules"),
        ("regex", "a" * 20_000, "bytes of regex"),
    ],
)
def test_each_attack_is_refused_by_its_bound_before_any_compile(kind, text, bound):
    start = time.perf_counter()
    with pytest.raises(ConstraintTooLarge, match=bound):
        check_limits(kind, text)
    assert time.perf_counter() - start < 1.0
    assert bound in limits_error(kind, text) and bound in compile_error(kind, text)


@pytest.mark.parametrize(
    "kind, text",
    [
        ("json", json.dumps(ref_chain(MAX_SCHEMA_DEPTH // 4))),
        # recursive (a linked list) and shared definitions: neither is deep
        (
            "json",
            json.dumps(
                {
                    "$defs": {
                        "n": {
                            "type": "object",
                            "properties": {
                                "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}
                            },
                        }
                    },
                    "$ref": "#/$defs/n",
                }
            ),
        ),
        (
            "json",
            json.dumps(
                {
                    "$defs": {
                        f"d{i}": {
                            "properties": {
                                "a": {"$ref": f"#/$defs/d{i + 1}"},
                                "b": {"$ref": f"#/$defs/d{i + 1}"},
                            }
                        }
                        for i in range(30)
                    },
                    "$ref": "#/$defs/d0",
                }
            ),
        ),
        ("json", json.dumps({"properties": {f"p{i}": {} for i in range(1000)}})),
        ("choice", json.dumps([f"c{i}" for i in range(4096)])),
        ("grammar", gbnf_chain(1_500)),
        ("regex", r"\d{4}-\d{2}" * 100),
    ],
)
def test_what_real_constraints_use_passes_the_bounds(kind, text):
    check_limits(kind, text)


def test_a_bound_fires_one_past_its_limit_and_not_at_it():
    check_limits("choice", json.dumps(["x"] * 4096))
    with pytest.raises(ConstraintTooLarge, match="4097 choices"):
        check_limits("choice", json.dumps(["x"] * 4097))


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= "a" b | c\nb ::= [0-9]+\nc ::= "x" c | "y"\n',
        'root ::= item ("," item)*\nitem ::= "k" | "v" # a comment\n',
        'root ::= fooBar\nfooBar ::= baz-qux "!"\nbaz-qux ::= [a-z]{2,5}\n',
        gbnf_chain(40),
    ],
)
def test_the_linear_converter_writes_what_llguidances_writes(grammar):
    assert gbnf.gbnf_to_lark(grammar) == llguidance_gbnf_to_lark(grammar)


def test_the_gbnf_check_is_linear_in_rules():
    """llguidance's converter took 1.1 s for 1,000 rules and 9.5 s for 3,000 (quadratic: 8x
    the rules would cost 64x); the core's costs about 8x, well under a second."""
    times = []
    for rules in (500, 4_000):
        start = time.perf_counter()
        gbnf.any_to_lark(gbnf_chain(rules))
        times.append(time.perf_counter() - start)
    assert times[1] < 2.0 and times[1] < 24 * max(times[0], 0.005), times


@pytest.mark.parametrize(
    "grammar, says",
    [
        ("root ::= ( \n", "Expected ')'"),
        ("root ::= missing\n", "rule 'missing' not found"),
        ('item ::= "a"\n', "no 'root' rule"),
    ],
)
def test_a_gbnf_syntax_error_is_one_short_line(grammar, says):
    error = compile_error("grammar", grammar)
    assert (
        says in error
        and len(error) < 400
        and "\n" not in error.strip()
        and "Traceback" not in error
    )
