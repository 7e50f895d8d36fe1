"""Continuous batching, chunked prefill and preemption by recompute keep greedy output exact."""

from __future__ import annotations

import pytest

from memstep.core.block_manager import BlockManager
from memstep.core.config import EngineConfig
from memstep.core.request import Request
from memstep.core.sampling_params import SamplingParams
from memstep.core.scheduler import Scheduler, is_decode
from memstep.executors.process.inprocess import local_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(chat_prompts):
    """The same model and precision (the GGUF's q4 on the CPU) with room for every prompt at
    once: no chunk, no preemption."""
    engine = local_engine(EngineConfig(dtype="float32"))
    return [c.token_ids for c in engine.generate(chat_prompts, GREEDY)]


def test_chunked_prefill_and_tight_pages_with_preemption(reference, chat_prompts):
    # 20 pages of 16 tokens cannot hold 8 prompts of ~40 tokens + 20 new tokens each at once
    cfg = EngineConfig(max_num_batched_tokens=32, num_kv_blocks=20, dtype="float32")
    engine = local_engine(cfg)
    plans: list = []
    engine.sinks.append(lambda rec: type(rec).__name__ == "StepPlanned" and plans.append(rec))
    got = engine.generate(chat_prompts, GREEDY)
    assert [c.token_ids for c in got] == reference
    assert engine.scheduler.num_preemptions > 0, "the page budget forced preemption"
    assert max(p.num_tokens for p in plans) <= 32, "token budget respected"
    assert engine.blocks.num_used == 0


def test_new_requests_join_running_ones(smol_engine, chat_prompts):
    eng = smol_engine
    first = eng.add_request(
        chat_prompts[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    for _ in range(3):
        eng.step()
    plans = []
    eng.sinks.append(plans.append)
    try:
        eng.add_request(
            chat_prompts[1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        )
        eng.step()
    finally:
        eng.sinks.remove(plans.append)
    batch = next(r for r in plans if type(r).__name__ == "StepPlanned").batch
    assert [row[0] for row in batch][0] == first and len(batch) == 2
    eng.run_until_idle()


BLOCK = 4


def _decoding(n: int, prompt_len: int, blocks: BlockManager, lookahead: int) -> Scheduler:
    """A scheduler whose `n` requests have prefilled `prompt_len` tokens and sampled one."""
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=BLOCK)
    sched = Scheduler(cfg, blocks, max_model_len=64, decode_lookahead=lookahead)
    for i in range(n):
        sched.add(Request(f"r{i}", list(range(1, prompt_len + 1)), GREEDY, str))
    for s in sched.schedule().seqs:  # the prefill
        s.request.num_computed += s.num_tokens
        s.request.output_token_ids.append(7)
    return sched


def test_decode_lookahead_reserves_the_next_slot_when_pages_are_free():
    # prompts of 3 tokens + 1 sampled: the decode feeds position 3, the last slot of page 0;
    # the step replayed ahead would feed position 4, in a second page
    plain = _decoding(3, 3, BlockManager(16, BLOCK), lookahead=0)
    batch = plain.schedule()
    assert [len(plain.blocks.table(s.request.request_id)) for s in batch.seqs] == [1, 1, 1]
    ahead = _decoding(3, 3, BlockManager(16, BLOCK), lookahead=1)
    batch = ahead.schedule()
    assert [s.num_tokens for s in batch.seqs] == [1, 1, 1]
    assert [len(ahead.blocks.table(s.request.request_id)) for s in batch.seqs] == [2, 2, 2]


def test_decode_lookahead_never_preempts_or_starves_a_step():
    # 4 pages for 3 decoding requests: each step's own slots take 3, one is left for lookahead
    sched = _decoding(3, 3, BlockManager(4, BLOCK), lookahead=1)
    batch = sched.schedule()
    assert len(batch.seqs) == 3 and sched.num_preemptions == 0
    tables = [len(sched.blocks.table(s.request.request_id)) for s in batch.seqs]
    assert sorted(tables) == [1, 1, 2] and sched.blocks.num_free == 0
    sched.blocks.check()


def test_decode_lookahead_reserves_the_slot_after_a_prompts_last_chunk():
    # prompts of 4 tokens fill page 0: the token sampled after them goes to position 4, in a
    # second page, which the replay ahead feeds; a chunk that samples nothing gets none
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=BLOCK)
    for lookahead, pages in ((0, [1, 1]), (1, [2, 2])):
        sched = Scheduler(
            cfg, BlockManager(16, BLOCK), max_model_len=64, decode_lookahead=lookahead
        )
        for i in range(2):
            sched.add(Request(f"r{i}", [1, 2, 3, 4], GREEDY, str))
        batch = sched.schedule()
        assert all(s.samples for s in batch.seqs)
        assert [len(sched.blocks.table(s.request.request_id)) for s in batch.seqs] == pages
    chunked = EngineConfig(max_num_seqs=8, max_num_batched_tokens=4, block_size=BLOCK)
    sched = Scheduler(chunked, BlockManager(16, BLOCK), max_model_len=64, decode_lookahead=1)
    sched.add(Request("long", list(range(1, 9)), GREEDY, str))
    (s,) = sched.schedule().seqs
    assert not s.samples and len(sched.blocks.table("long")) == 1


def _step(sched: Scheduler) -> list[bool]:
    """Schedule and run one step (one token sampled per sequence that samples); the batch's
    decode flag and `is_decode` of its sequences, as computed before the step ran."""
    batch = sched.schedule()
    flags = [batch.is_decode, is_decode(batch.seqs)]
    for s in batch.seqs:
        sampled = s.samples
        s.request.num_computed += s.num_tokens
        if sampled:
            s.request.output_token_ids.append(7)
    return flags


def test_the_batch_decode_flag_is_what_its_sequences_say():
    """`StepBatch.is_decode`, found while scheduling, equals `is_decode(seqs)`: for one-token
    admissions (a decode), a long prompt admitted with the one token the budget leaves (no
    sample), that prompt's next one-token chunk, and for prefills, chunks, decodes and
    preemptions over many steps."""
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=4, block_size=BLOCK)
    sched = Scheduler(cfg, BlockManager(64, BLOCK), max_model_len=64)
    for i in range(3):
        sched.add(Request(f"r{i}", [5], GREEDY, str))
    assert _step(sched) == [True, True]
    sched.add(Request("long", list(range(1, 9)), GREEDY, str))
    assert _step(sched) == [False, False], "the long prompt's first token samples nothing"
    assert _step(sched) == [False, False], "its second chunk, one token, samples nothing"
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=6, block_size=BLOCK)
    sched = Scheduler(cfg, BlockManager(7, BLOCK), max_model_len=64)
    for i in range(3):
        sched.add(Request(f"r{i}", [1, 2], GREEDY, str))
    seen = [_step(sched) for _ in range(2)]
    sched.add(Request("long", list(range(1, 9)), GREEDY, str))
    seen += [_step(sched) for _ in range(12)]
    assert all(flag == expected for flag, expected in seen), seen
    assert {flag for flag, _ in seen} == {True, False}
    assert sched.num_preemptions > 0, "7 pages of 4 slots ran out: some steps preempted"
