"""Continuous batching, chunked prefill and preemption by recompute keep greedy output exact."""

from __future__ import annotations

import pytest

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(smol_engine, chat_prompts):
    return [c.token_ids for c in smol_engine.generate(chat_prompts, GREEDY)]


def test_chunked_prefill_and_tight_pages_with_preemption(reference, chat_prompts):
    # 20 pages of 16 tokens cannot hold 8 prompts of ~40 tokens + 20 new tokens each at once
    cfg = EngineConfig(max_num_batched_tokens=32, num_kv_blocks=20, dtype="float32")
    engine = Engine(cfg)
    plans: list = []
    engine.sinks.append(lambda rec: type(rec).__name__ == "StepPlanned" and plans.append(rec))
    got = engine.generate(chat_prompts, GREEDY)
    assert [c.token_ids for c in got] == reference
    assert engine.scheduler.num_preemptions > 0, "the page budget forced preemption"
    assert max(p.num_tokens for p in plans) <= 32, "token budget respected"
    assert engine.blocks.num_used == 0


def test_new_requests_join_running_ones(smol_engine, chat_prompts):
    eng = smol_engine
    first = eng.add_request(chat_prompts[0], SamplingParams(max_tokens=12, ignore_eos=True))
    for _ in range(3):
        eng.step()
    plans = []
    eng.sinks.append(plans.append)
    try:
        eng.add_request(chat_prompts[1], SamplingParams(max_tokens=4, ignore_eos=True))
        eng.step()
    finally:
        eng.sinks.remove(plans.append)
    batch = next(r for r in plans if type(r).__name__ == "StepPlanned").batch
    assert [row[0] for row in batch][0] == first and len(batch) == 2
    eng.run_until_idle()
