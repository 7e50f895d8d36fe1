"""Per-request adaptive K: the largest whose last draft is accepted often enough, from the
request's decayed acceptance, within [1, num_speculative_tokens]; greedy output stays the
target's own."""

from __future__ import annotations

import pytest

from memstep.core.config import EngineConfig
from memstep.core.draft_length import MIN_LAST_DRAFT, adapt, best_k
from memstep.core.request import Request
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import DraftLengthChanged, StepPlanned
from memstep.executors.process.inprocess import local_engine


def request() -> Request:
    return Request("r", [1, 2, 3], SamplingParams(), lambda ids: "")


def test_k_follows_the_acceptance_of_its_last_draft():
    req = request()
    assert adapt(req, 0, 0, 3) is None and req.draft_trials == 0.0, "no drafts: no evidence"
    assert adapt(req, 3, 0, 3) == 2, "one miss on a prior of one half: 1/3 a draft, K 2"
    assert adapt(req, 2, 0, 3) == 1
    for _ in range(4):
        assert adapt(req, 1, 0, 3) is None, "never below 1"
    for _ in range(6):
        adapt(req, 1, 1, 3)
    assert req.draft_length == 3, "every draft accepted: back up to K, one a step"
    assert adapt(req, 3, 3, 3) is None and req.draft_length == 3, "never above K"


def test_a_head_that_accepts_a_third_keeps_k_2_where_two_misses_in_a_row_dropped_it():
    """Accepted 0, 1, 0, 0, 2, 0, 1, 0, 0, ... of 2 drafts: 4 of the 12 drafts judged, as a
    head with alpha 1/3 does on average. The rule before dropped K after two misses in a row."""
    req = request()
    ks = []
    for step in range(30):
        adapt(req, req.draft_length or 2, [0, 1, 0, 0, 2, 0, 1, 0, 0][step % 9], 2)
        ks.append(req.draft_length)
    assert ks == [2] * 30
    assert best_k(1 / 3, 2) == 2 and best_k(0.2, 3) == 1 and best_k(0.5, 3) == 3
    assert best_k(0.25, 2) == 2 and best_k(0.24, 2) == 1, f"the floor: {MIN_LAST_DRAFT}"
    assert best_k(0.0, 3) == 1 and best_k(1.0, 3) == 3


def test_the_scheduler_gives_a_request_its_own_k():
    engine = local_engine(
        EngineConfig(
            model="random:tiny",
            num_threads=1,
            speculative_method="ngram",
            num_speculative_tokens=4,
            speculative_auto_disable=False,
        )
    )
    rid = engine.add_request([7, 8, 9, 7, 8, 9, 7], SamplingParams(temperature=0, max_tokens=30))
    engine.step()  # the prefill
    engine.requests[rid].draft_length = 2
    batch = engine.scheduler.schedule()
    assert [s.num_drafts for s in batch.seqs] == [2]
    engine.scheduler.running.clear()
    engine.shutdown()


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(smol_engine, chat_prompts):
    return [c.token_ids for c in smol_engine.generate(chat_prompts[:2], GREEDY)]


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_greedy_output_with_adaptive_k_is_the_targets(method, reference, chat_prompts):
    cfg = EngineConfig(
        dtype="float32",
        quantization="none",
        speculative_method=method,
        num_speculative_tokens=3,
        speculative_auto_disable=False,  # every step spec: K moves at every one
    )
    seen: list[object] = []
    engine = local_engine(cfg, sinks=[seen.append])
    got = [c.token_ids for c in engine.generate(chat_prompts[:2], GREEDY)]
    engine.shutdown()
    assert got == reference
    changes = [r for r in seen if isinstance(r, DraftLengthChanged)]
    assert any(c.new < c.old for c in changes), "some request's drafts kept failing"
    assert {r.kind for r in seen if isinstance(r, StepPlanned)} == {"spec"}
