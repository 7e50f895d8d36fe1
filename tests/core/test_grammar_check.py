"""Compile checks in worker processes (core/grammar_check.py) and the core's verdicts
(core/grammar.py's ConstraintBook): a worker that dies or stalls costs its check a clear
verdict and the next check a fresh worker, and the verdicts stay within their byte budget."""

from __future__ import annotations

import json
import os
import signal

import pytest

from memstep.core import grammar
from memstep.core.grammar import ConstraintBook, TextCache, TokenizerSpec, compile_error
from memstep.core.grammar_check import Check, GrammarChecker
from memstep.core.grammar_worker import build_tokenizer
from memstep.core.model_source import model_config, resolve

GOOD = ("regex", "[a-z]+")


@pytest.fixture
def checker():
    checker = GrammarChecker(num_workers=1, budget_s=20.0)
    yield checker
    checker.close()


def _stopped_worker(checker: GrammarChecker) -> int:
    """The one worker, warm, then stopped (SIGSTOP): it reads nothing and answers nothing."""
    assert checker.wait(checker.submit(*GOOD)) == ""
    (pid,) = checker.pids()
    os.kill(pid, signal.SIGSTOP)
    return pid


def test_a_check_answers_why_a_constraint_does_not_compile(checker):
    assert checker.wait(checker.submit(*GOOD)) == ""
    assert "unclosed" in checker.wait(checker.submit("regex", "(unclosed"))
    assert "Expected" in checker.wait(checker.submit("grammar", "root ::= ( \n"))


def test_a_worker_that_dies_mid_check_is_that_checks_refusal_and_is_replaced(checker):
    pid = _stopped_worker(checker)
    check = checker.submit("json", json.dumps({"type": "string"}))
    os.kill(pid, signal.SIGKILL)  # as a segfault or a stack overflow ends it
    assert "crashed the grammar engine" in checker.wait(check)
    assert checker.num_crashed == 1
    assert checker.wait(checker.submit(*GOOD)) == "" and checker.pids() != [pid]


def test_a_check_past_the_compile_budget_is_refused_and_its_worker_killed(checker):
    checker.budget_s = 0.5
    pid = _stopped_worker(checker)
    slow = checker.submit("regex", "b+")
    assert "compile budget" in checker.wait(slow) and not slow.lasting  # (not kept)
    assert checker.num_timed_out == 1
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    checker.budget_s = 20.0
    assert checker.wait(checker.submit(*GOOD)) == ""


def test_checks_queue_past_the_workers_and_each_is_answered(checker):
    checks = [checker.submit("regex", f"x{{{i}}}") for i in range(1, 6)]
    assert [checker.wait(c) for c in checks] == [""] * 5 and len(checker.pids()) == 1


def test_the_book_keeps_verdicts_and_refuses_bounds_without_a_worker():
    book = ConstraintBook()
    try:
        assert "choices" in book.error("choice", json.dumps(["a"] * 5000))
        assert book._checker is None  # the bound refused it in this process
        assert book.error(*GOOD) == "" and book.known(*GOOD) == ""
        book.checker.close()  # no worker left: a known verdict needs none
        assert book.error(*GOOD) == "" and book.checker.pids() == []
    finally:
        book.close()


def test_a_text_cache_keeps_the_recent_within_its_bytes():
    cache: TextCache[str] = TextCache(budget_bytes=10_000)
    for i in range(1000):
        cache.put(("json", f'{{"n": {i:04d}}}' + " " * 80), "", 0)
        assert cache.num_bytes <= 10_000
    assert 90 <= len(cache) < 120
    assert cache.get(("json", '{"n": 0999}' + " " * 80)) == ""
    assert cache.get(("json", '{"n": 0000}' + " " * 80)) is None
    cache.put(("json", "x" * 20_000), "", 0)  # one past the whole budget: not kept
    assert cache.num_bytes <= 10_000


@pytest.fixture(scope="module")
def tiny_tokenizer():
    mc = model_config(resolve("random:tiny"))
    return build_tokenizer(TokenizerSpec("random:tiny", 0, None, mc.vocab_size, mc.eos_token_ids))


def test_a_compile_against_the_tokenizer_past_its_budget_is_refused(tiny_tokenizer, monkeypatch):
    assert compile_error(*GOOD, tiny_tokenizer) == ""
    monkeypatch.setattr(grammar, "COMPILE_BUDGET_S", 0.0)  # planted: every compile too slow
    assert "compile, more than the budget of 0 s" in compile_error(*GOOD, tiny_tokenizer)


def test_the_books_workers_check_against_its_models_tokenizer():
    mc = model_config(resolve("random:tiny"))
    book = ConstraintBook()
    try:
        assert book.error("regex", "before") == ""  # a worker without a tokenizer
        book.use_model(TokenizerSpec("random:tiny", 0, None, mc.vocab_size, mc.eos_token_ids))
        assert book.known("regex", "before") is None  # verdicts of another tokenizer: dropped
        assert book.error(*GOOD) == "" and "unclosed" in book.error("regex", "(unclosed")
        (pid,) = book.checker.pids()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert b'"model": "random:tiny"' in f.read()
    finally:
        book.close()


def test_the_same_constraint_at_once_is_checked_once():
    book = ConstraintBook()
    try:
        first, second = book.start("regex", "q{3}"), book.start("regex", "q{3}")
        assert first is second and book.error("regex", "q{3}") == ""
        assert book.start("regex", "q{3}").error == ""  # known now: no check at all
    finally:
        book.close()


def test_a_verdict_of_a_slow_moment_is_not_kept():
    book = ConstraintBook()
    book.keep(Check("regex", "a", f"took 1.2 s to {grammar.OVER_BUDGET} of 1 s"))
    book.keep(Check("regex", "b", "took longer than the 10 s compile budget", lasting=False))
    book.keep(Check("regex", "c", "unclosed"))
    assert book.known("regex", "a") is None and book.known("regex", "b") is None
    assert book.known("regex", "c") == "unclosed"
