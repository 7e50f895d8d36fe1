"""A failure of the grammar engine on one request ends that request, never the executor
(issue 55: a 100k-string choice panicked the matcher, the executor was lost and the request
re-admitted until the engine died): its compile failing, or its matcher failing mid-text."""

from __future__ import annotations

import re

from memstep import LLM
from memstep.core.model_source import model_config, resolve
from memstep.core.sampling_params import SamplingParams as CoreParams
from memstep.events.plan import Admission, SeqPlan
from memstep.executors.runtime.guide import GrammarBook, Guide
from memstep.executors.runtime.running_requests import RunningRequests

SOURCE = resolve("random:tiny")
MC = model_config(SOURCE)


class Panic(BaseException):
    """What pyo3 raises for a panic in Rust: a BaseException, not an Exception."""


class PanickingMatcher:
    """A real matcher that panics at its third mask."""

    def __init__(self, matcher):
        self.matcher, self.masks = matcher, 0

    def unsafe_compute_mask_ptr(self, *args):
        self.masks += 1
        if self.masks >= 3:
            raise Panic("assertion failed: grammar.symbols.len() < u16::MAX")
        return self.matcher.unsafe_compute_mask_ptr(*args)

    def __getattr__(self, name):
        return getattr(self.matcher, name)


def test_a_compile_that_panics_is_that_requests_failure(monkeypatch):
    def panics(book, constraint):  # as llguidance on a 100k-string choice (43 s to get there)
        raise Panic("assertion failed: grammar.symbols.len() < u16::MAX as usize - 10")

    monkeypatch.setattr(GrammarBook, "_compile", panics)
    states = RunningRequests(GrammarBook(SOURCE, MC.vocab_size, MC.eos_token_ids))
    params = CoreParams(guided_choice=["yes", "no"], seed=1)
    seq = SeqPlan("r", 0, [5, 6], [0], True, 0, 2)
    state = states.update(seq, Admission(request_id="r", params=params, prefix_ids=[]))
    assert state.guide is None and "symbols.len() < u16::MAX" in state.failure
    assert list(states.failures(["r"])) == ["r"]


def test_a_matcher_that_panics_mid_text_ends_its_request_and_the_others_go_on(monkeypatch):
    made = GrammarBook.guide

    def panicking(book, constraint):
        guide = made(book, constraint)
        return Guide(PanickingMatcher(guide.matcher), guide.eos, guide.stand_in)

    monkeypatch.setattr(GrammarBook, "guide", panicking)
    llm = LLM(model="random:tiny")  # kept: a collected LLM shuts its engine down
    engine = llm.engine
    constrained = CoreParams(max_tokens=12, seed=2, guided_regex="[a-z]{30}")
    plain = CoreParams(max_tokens=12, seed=2, ignore_eos=True)
    failed, served = engine.generate(["One", "Two"], [constrained, plain])  # one batch
    # the two tokens masked before the panic, in the grammar; nothing after it
    assert failed.finish_reason == "error" and re.fullmatch("[a-z]{0,2}", failed.text), failed
    assert served.finish_reason == "length" and len(served.token_ids) == 12
    assert engine.num_losses == 0 and engine.num_failed == 1
