"""Block-manager invariants under random alloc / append / free / preempt sequences."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from memstep.core.block_manager import BlockManager

NUM_BLOCKS, BLOCK_SIZE = 24, 4


class PagesMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.tokens: dict[str, int] = {}
        self.next_id = 0

    @rule(n=st.integers(1, 40))
    def allocate(self, n):
        rid = f"r{self.next_id}"
        self.next_id += 1
        before = self.blocks.num_free
        if self.blocks.ensure(rid, n):
            self.tokens[rid] = n
            assert len(self.blocks.table(rid)) == self.blocks.blocks_needed(n)
        else:
            assert self.blocks.num_free == before, "a refused allocation took pages"
            assert self.blocks.table(rid) == []

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(1, 9))
    def append(self, data, extra):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.blocks.ensure(rid, self.tokens[rid] + extra):
            self.tokens[rid] += extra
        assert len(self.blocks.table(rid)) >= self.blocks.blocks_needed(self.tokens[rid])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free_or_preempt(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        owned = len(self.blocks.table(rid))
        assert self.blocks.free(rid) == owned
        del self.tokens[rid]
        assert self.blocks.table(rid) == []

    @invariant()
    def pages_add_up(self):
        self.blocks.check()
        owned = sum(len(self.blocks.table(r)) for r in self.tokens)
        assert owned + self.blocks.num_free == NUM_BLOCKS
        assert set(self.blocks.owners()) <= set(self.tokens)


TestPages = PagesMachine.TestCase
TestPages.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_check_catches_a_page_owned_twice_without_a_reference():
    blocks = BlockManager(4, 2)
    blocks.ensure("a", 2)
    blocks._tables["b"] = list(blocks.table("a"))  # corrupt on purpose: shared, counted once
    try:
        blocks.check()
    except AssertionError as exc:
        assert "reference count" in str(exc)
    else:
        raise AssertionError("check() missed a page owned twice")


def test_finished_and_aborted_requests_return_all_pages(smol_engine, chat_prompts):
    from memstep.core.sampling_params import SamplingParams

    eng = smol_engine
    ids = [
        eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=6)) for p in chat_prompts[:6]
    ]
    eng.step()
    eng.step()
    assert eng.blocks.num_used > 0
    eng.abort(ids[0])
    eng.abort(ids[3])
    eng.run_until_idle()
    assert eng.blocks.num_used == 0
    assert eng.blocks.num_free == eng.blocks.num_blocks
    eng.blocks.check()
