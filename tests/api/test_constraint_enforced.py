"""Every enforced constraint either holds in the text or ends its request with an error finish
(issue 55): where llguidance's parser gives up (a row of more than 2,000 Earley items: 700
optional properties, 3,500 choices, 5,000 GBNF alternatives), the request ends with
finish_reason "error" and the reason, never with text outside its constraint.  A planted silent
drop (the matcher's error ignored, as before: every token allowed) fails the same check."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from memstep import LLM, SamplingParams
from memstep.executors.runtime.guide import Guide

PROPS = {f"p{i}": {"type": "string", "maxLength": 3} for i in range(700)}
SCHEMA = {"type": "object", "properties": PROPS, "additionalProperties": False}
CHOICES = [f"choice {i}" for i in range(3500)]
ALTS = [f"alt{i}" for i in range(5000)]
CASES = {
    "700 optional properties": {"guided_json": json.dumps(SCHEMA)},
    "3,500 choices": {"guided_choice": CHOICES},
    "5,000 GBNF alternatives": {
        "guided_grammar": "root ::= " + " | ".join(f'"{a}"' for a in ALTS) + "\n"
    },
}
# every prefix of a text of SCHEMA's shape: {"pN":"vvv",...}
_MEMBER = r'"p\d+":"[^"\\]{0,3}"'
_PARTIAL = r'"(p\d*("(:("[^"\\]{0,3}"?)?)?)?)?'
_SCHEMA_PREFIX = re.compile(rf"(\{{(\}}|({_MEMBER},)*({_MEMBER}\}}?|{_PARTIAL})?)?)?")


def _holds(case: str, text: str, finished: bool) -> bool:
    """Whether `text` keeps the case's constraint: whole where the request stopped, a prefix
    of a text that keeps it where it ended early."""
    if case.startswith("700"):
        if not finished:
            return _SCHEMA_PREFIX.fullmatch(text) is not None
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    whole = CHOICES if case.startswith("3,500") else ALTS
    return text in whole if finished else any(w.startswith(text) for w in whole)


def violations(llm: LLM) -> list[str]:
    """The requests whose text breaks their constraint without an error finish."""
    found = []
    for case, constraint in CASES.items():
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=5, **constraint)
        for out in llm.generate(["Say something."] * 4, params, use_tqdm=False):
            choice = out.outputs[0]
            if choice.finish_reason == "error":
                assert not _holds(case, choice.text + "\x00", False)  # (the check can fail)
                continue
            if not _holds(case, choice.text, choice.finish_reason == "stop"):
                found.append(f"{case}: {choice.finish_reason} {choice.text[:40]!r}")
    return found


@pytest.fixture(scope="module")
def llm():
    return LLM(model="random:tiny")


def test_every_constraint_holds_or_its_request_ends_with_an_error(llm):
    assert violations(llm) == []
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5, **CASES["3,500 choices"])
    [out] = llm.generate(["Pick one."], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "error"
    assert llm.engine.num_failed >= 13


def test_a_planted_silent_drop_fails_the_check(llm, monkeypatch):
    monkeypatch.setattr(Guide, "note_failure", lambda self: None)
    assert len(violations(llm)) >= 6
