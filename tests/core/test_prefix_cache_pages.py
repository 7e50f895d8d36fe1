"""Prefix-caching page accounting under random admit / compute / free sequences.

The machine keeps its own model of what every KV slot holds (the tokens up to it) and checks that
a hit only ever hands out slots that hold the request's own prefix, that a page in use is never
evicted (its slots are never overwritten while a request reads them), that reference counts equal
the number of holders, that eviction takes the least recently released cached page, and that
capacity is never exceeded.  Two planted bugs show that the machine catches what it claims to.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from memstep.core.block_manager import BlockManager, Prefix, block_hash

NUM_BLOCKS, BLOCK_SIZE = 10, 2
# few distinct tokens, so that prompts share prefixes of every length
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=9)
SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)


class CachedPagesMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}  # the model's copy: tables only ever grow
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (page, slot) -> tokens up to it
        self.lru: list[int] = []  # cached pages no request holds, least recently released first
        self.next_id = 0

    # --- rules -------------------------------------------------------------------------------

    @rule(tokens=TOKENS, n=st.integers(1, 4))
    def admit(self, tokens, n):
        rid = f"r{self.next_id}"
        self.next_id += 1
        prefix = self.blocks.lookup(tokens)
        hit = len(prefix.pages) * BLOCK_SIZE
        assert hit < len(tokens), "a hit must leave a token to compute"
        for pos in range(hit):
            page = prefix.pages[pos // BLOCK_SIZE]
            assert self.slots[(page, pos % BLOCK_SIZE)] == tuple(tokens[: pos + 1]), "wrong KV"
        target = min(len(tokens), hit + n)
        grow = lambda: self.blocks.allocate(rid, prefix, target)  # noqa: E731
        taken = self._taking(rid, grow, prefix.pages)
        if taken is None:
            assert self.blocks.table(rid) == [], "a refused allocation kept pages"
            return
        self.tokens[rid], self.computed[rid] = tokens, hit
        self.tables[rid] = list(prefix.pages) + taken
        self._compute(rid, target)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 4))
    def step(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        target = min(len(self.tokens[rid]) + 2, self.computed[rid] + n)  # +2: decode slots
        taken = self._taking(rid, lambda: self.blocks.ensure(rid, target), [])
        if taken is not None:
            self.tables[rid] += taken
            self._compute(rid, min(target, len(self.tokens[rid])))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        table = self.tables.pop(rid)
        assert self.blocks.free(rid) == len(table)
        del self.tokens[rid], self.computed[rid]
        for page in reversed(table):
            if self.blocks.refs(page) == 0 and self.blocks.is_cached(page):
                self.lru.append(page)

    # --- the model ---------------------------------------------------------------------------

    def _taking(self, rid: str, grow, hits: list[int]) -> list[int] | None:
        """Run `grow` for `rid`; the pages it took new, checked against least-recently-used
        eviction (free pages that cache nothing go first)."""
        cached_before = {p for p in range(NUM_BLOCKS) if self.blocks.is_cached(p)}
        kept = len(self.tables.get(rid, hits))
        lru = [p for p in self.lru if p not in hits]
        if not grow():
            return None
        taken = self.blocks.table(rid)[kept:]
        evicted = [p for p in taken if p in cached_before]
        uncached_free = self.blocks.num_free + len(taken) - len(lru)
        expected = lru[: max(0, len(taken) - uncached_free)]
        assert sorted(evicted) == sorted(expected), (
            f"evicted {evicted}, least recently used first: {expected}"
        )
        assert not any(self.blocks.is_cached(p) for p in evicted), "an evicted page stays cached"
        self.lru = [p for p in lru if p not in evicted]
        return taken

    def _compute(self, rid: str, target: int) -> None:
        """Write the KV of positions computed..target, then offer full blocks to the cache."""
        tokens, table = self.tokens[rid], self.tables[rid]
        for pos in range(self.computed[rid], target):
            self.slots[(table[pos // BLOCK_SIZE], pos % BLOCK_SIZE)] = tuple(tokens[: pos + 1])
        self.computed[rid] = target
        self.blocks.commit(rid, target, lambda a, b: tokens[a:b])

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def pages_add_up(self):
        self.blocks.check()
        for rid, table in self.tables.items():
            assert self.blocks.table(rid) == table, "a table changed under its request"
        for page in range(NUM_BLOCKS):
            holders = sum(page in t for t in self.tables.values())
            assert self.blocks.refs(page) == holders, f"page {page}: refs != holders"
        assert self.blocks.num_used == len({p for t in self.tables.values() for p in t})
        assert self.blocks.num_used <= NUM_BLOCKS
        assert self.blocks.num_cached == len(self.lru)

    @invariant()
    def held_pages_keep_their_kv(self):
        for rid, table in self.tables.items():
            tokens = self.tokens[rid]
            for pos in range(self.computed[rid]):
                slot = self.slots[(table[pos // BLOCK_SIZE], pos % BLOCK_SIZE)]
                assert slot == tuple(tokens[: pos + 1]), f"{rid}: a page in use was overwritten"


TestCachedPages = CachedPagesMachine.TestCase
TestCachedPages.settings = SETTINGS


def test_the_machine_catches_an_eviction_that_is_not_lru(monkeypatch):
    def release_to_the_front(self, page):
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free[page] = None
            self._free.move_to_end(page, last=False)  # planted: newest cached page taken first
            self._num_cached_free += page in self._hash_of

    monkeypatch.setattr(BlockManager, "_release", release_to_the_front)
    with pytest.raises(AssertionError, match="least recently used"):
        run_state_machine_as_test(CachedPagesMachine, settings=SETTINGS)


def test_the_machine_catches_a_stale_hit_on_an_evicted_page(monkeypatch):
    def take_keeping_the_hash(self):
        page, _ = self._free.popitem(last=False)
        self._refs[page] = 1  # planted: the page's old hash still offers it to lookups
        return page

    monkeypatch.setattr(BlockManager, "_take", take_keeping_the_hash)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(CachedPagesMachine, settings=SETTINGS)


def test_check_catches_a_wrong_reference_count_and_a_held_free_page():
    blocks = BlockManager(4, 2)
    blocks.allocate("a", Prefix(), 3)
    blocks._refs[blocks.table("a")[0]] += 1  # corrupt on purpose
    with pytest.raises(AssertionError, match="reference count"):
        blocks.check()
    blocks = BlockManager(4, 2)
    blocks.allocate("a", Prefix(), 3)
    blocks._free[blocks.table("a")[0]] = None  # corrupt on purpose
    with pytest.raises(AssertionError, match="both free and held"):
        blocks.check()


def test_idle_check_tells_cached_pages_from_held_ones():
    blocks = BlockManager(4, 2)
    tokens = [1, 2, 3, 4, 5]
    blocks.allocate("a", blocks.lookup(tokens), 5)
    blocks.commit("a", 5, lambda a, b: tokens[a:b])
    with pytest.raises(AssertionError, match="3 pages held with no request running"):
        blocks.check_idle()
    blocks.free("a")
    blocks.check_idle()  # two pages stay cached: KV to reuse, not a leak
    assert blocks.num_cached == 2 and blocks.num_used == 0 and blocks.num_free == 4
    hit = blocks.lookup(tokens)
    assert hit.hashes == [block_hash(None, [1, 2]), block_hash(hit.hashes[0], [3, 4])]


def test_salt_and_parent_keep_equal_blocks_apart():
    assert block_hash(None, [1, 2]) != block_hash(None, [1, 2], b"salt")
    assert block_hash(None, [3, 4]) != block_hash(block_hash(None, [1, 2]), [3, 4])


def test_drop_cache_and_reset_forget_every_hit():
    blocks = BlockManager(6, 2)
    tokens = [1, 2, 3, 4, 5]
    blocks.allocate("a", Prefix(), 5)
    blocks.commit("a", 5, lambda a, b: tokens[a:b])
    blocks.drop_cache()  # after an executor crash: held pages stay held, nothing is offered
    assert blocks.lookup(tokens).pages == [] and blocks.num_used == 3
    blocks.check()
    blocks.commit("a", 5, lambda a, b: tokens[a:b])
    blocks.reset()
    assert blocks.lookup(tokens).pages == [] and blocks.num_free == 6 and not blocks.owners()
    blocks.check_idle()


def test_caching_off_never_hits():
    blocks = BlockManager(6, 2, enable_caching=False)
    tokens = [1, 2, 3, 4, 5]
    blocks.allocate("a", Prefix(), 5)
    blocks.commit("a", 5, lambda a, b: tokens[a:b])
    blocks.free("a")
    assert blocks.lookup(tokens).pages == [] and blocks.num_cached == 0
