"""`memstep replay` of a log that holds a poisoned request (issue 55: a 1,000-deep `$ref` chain,
a 100k-string choice, a 10k-rule grammar, as an older engine admitted them or a hand edited
in): the replay refuses each such input with its bound, reports it, and exits with the
divergence it caused; never a crash of the replaying process."""

from __future__ import annotations

import json

import attrs
from replay_helpers import memstep

from memstep.events.log import LogWriter, read_log
from memstep.events.types import RequestAdded

RESERVED = ("format_version", "memstep_version", "created")


def _ref_chain(depth: int) -> str:
    defs = {
        f"a{i}": {"type": "array", "items": {"$ref": f"#/$defs/a{i + 1}"}} for i in range(depth)
    }
    defs[f"a{depth}"] = {"type": "string"}
    return json.dumps({"$ref": "#/$defs/a0", "$defs": defs})


def _grammar_chain(rules: int) -> str:
    body = "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(rules))
    return f'root ::= r0\n{body}r{rules} ::= "b"\n'


POISONS = [
    {"guided_json": _ref_chain(1000)},
    {"guided_choice": [f"option {i}" for i in range(100_000)]},
    {"guided_grammar": _grammar_chain(10_000)},
]


def test_replay_of_a_poisoned_log_refuses_the_poison_and_exits_with_its_reason(tiny_log, tmp_path):
    header, records, problems = read_log(tiny_log.path)
    assert problems == []
    added = [i for i, rec in enumerate(records) if isinstance(rec, RequestAdded)]
    poisoned = tmp_path / "poisoned.memlog"
    with LogWriter(poisoned, {k: v for k, v in header.items() if k not in RESERVED}) as writer:
        for i, rec in enumerate(records):
            if i in added[: len(POISONS)]:
                rec = attrs.evolve(rec, params={**rec.params, **POISONS[added.index(i)]})
            writer.append(rec)
    code, out, err = memstep("replay", str(poisoned))
    assert code == 1, (out, err)
    assert "Traceback" not in out + err
    skipped = [line for line in out.splitlines() if "skipped input" in line]
    assert len(skipped) == 3, out
    assert "nested deeper" in skipped[0] and "bytes of constraint text" in skipped[1]
    assert "grammar rules" in skipped[2]
