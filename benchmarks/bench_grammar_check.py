"""The core's check of a GBNF grammar against its size: a chain of N rules (each refers to the
next), converted to Lark by llguidance's own converter and by the core's (core/gbnf.py), then
the core's whole check (bounds, conversion, llguidance's validation) in a check worker.

    python benchmarks/bench_grammar_check.py                  # 1,000 and 3,000 rules
    python benchmarks/bench_grammar_check.py --rules 500,1000,2000
"""

from __future__ import annotations

import argparse
import time

from llguidance.gbnf_to_lark import gbnf_to_lark as llguidance_gbnf_to_lark

from memstep.core.gbnf import gbnf_to_lark
from memstep.core.grammar import ConstraintBook


def chain(rules: int) -> str:
    body = "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(rules))
    return f'root ::= r0\n{body}r{rules} ::= "b"\n'


def timed(call, *args):
    """(seconds, result) of `call(*args)`."""
    start = time.perf_counter()
    result = call(*args)
    return time.perf_counter() - start, result


def row(book: ConstraintBook, rules: int) -> str:
    grammar = chain(rules)
    theirs, _ = timed(llguidance_gbnf_to_lark, grammar)
    ours, _ = timed(gbnf_to_lark, grammar)
    check, verdict = timed(book.error, "grammar", grammar)
    return f"{rules:>6} {theirs:>13.3f} {ours:>8.3f} {check:>8.3f}  {verdict or 'compiles'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", default="1000,3000", help="chain lengths, comma-separated")
    args = parser.parse_args()
    book = ConstraintBook()
    book.error("regex", "warm")  # the check worker started
    print(f"{'rules':>6} {'llguidance s':>13} {'core s':>8} {'check s':>8}  verdict")
    for rules in map(int, args.rules.split(",")):
        print(row(book, rules))
    book.close()


if __name__ == "__main__":
    main()
