"""Page accounting for the paged KV cache, with automatic prefix caching.

The block manager only counts; the pages themselves are tensors in the executor.  A page is free
or held by one or more requests (its reference count is the number of tables that list it).  Once
every slot of a page holds computed KV, the page is cached under the hash chain of its tokens
(the parent block's hash, the block's tokens, extra keys such as a cache salt), so that a later
request with the same prefix lists the same page instead of computing it again.

A page that no request holds stays cached until a new page is needed: free pages that cache
nothing are taken first, then cached ones, least recently released first.  Cached free pages are
KV the engine can take back at once: they count as free, never as held, and never as a leak.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator

import attrs

from memstep.core.shapes import cdiv


def block_hash(parent: bytes | None, tokens: list[int], extra: bytes = b"") -> bytes:
    """The key of a full block: it names every token before it through `parent`, so equal keys
    mean equal prefixes (not just equal blocks).  sha256, stable across processes and replays."""
    return next(chain_hashes(parent, tokens, len(tokens), extra))


def chain_hashes(
    parent: bytes | None, tokens: list[int], block_size: int, extra: bytes = b""
) -> Iterator[bytes]:
    """`block_hash` of each full block of `tokens` in turn, each the parent of the next; the
    tokens packed once for all blocks (hashing is most of what caching costs a step)."""
    packed = struct.pack(f"<{len(tokens)}q", *tokens)
    width = 8 * block_size
    for start in range(0, len(packed) - width + 1, width):
        h = hashlib.sha256(parent or b"root")
        h.update(packed[start : start + width])
        h.update(extra)
        parent = h.digest()
        yield parent


@attrs.frozen
class Prefix:
    """Cached pages that hold a request's first `len(pages)` full blocks, and their hashes."""

    pages: list[int] = attrs.Factory(list)
    hashes: list[bytes] = attrs.Factory(list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._refs = [0] * num_blocks
        # pages no request holds, in the order they are taken: uncached first, then cached ones
        # least recently released first (an OrderedDict: a hit takes a page out of the middle)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._cached: dict[bytes, int] = {}  # hash -> page
        self._hash_of: dict[int, bytes] = {}  # page -> hash, for every cached page
        self._chains: dict[str, list[bytes]] = {}  # hashes of each request's computed full blocks
        self._num_cached_free = 0

    # --- figures ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages a request can take now: the uncached free pages and the cached free ones."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages held by at least one request."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages that cache a block and that no request holds: reclaimable KV."""
        return self._num_cached_free

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def owners(self) -> list[str]:
        return list(self._tables)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def is_cached(self, page: int) -> bool:
        return page in self._hash_of

    # --- prefix hits -----------------------------------------------------------------------

    def lookup(self, tokens: list[int], extra: bytes = b"") -> Prefix:
        """The longest run of cached full blocks that starts `tokens`, leaving at least one
        token to compute (its logits are sampled).  Hashes blocks only until the first miss,
        and none while nothing is cached."""
        if not self._cached:  # caching off, or nothing to match yet
            return Prefix()
        bs = self.block_size
        prefix = Prefix()
        full = (len(tokens) - 1) // bs
        for h in chain_hashes(None, tokens[: full * bs], bs, extra):
            page = self._cached.get(h)
            if page is None:
                break
            prefix.pages.append(page)
            prefix.hashes.append(h)
        return prefix

    def allocate(self, request_id: str, prefix: Prefix, num_tokens: int) -> bool:
        """Start the request's table with the `prefix` pages, grown to hold `num_tokens` slots;
        all or nothing."""
        assert request_id not in self._tables, f"{request_id} already holds pages"
        reused_free = sum(1 for p in prefix.pages if self._refs[p] == 0)
        extra = max(0, self.blocks_needed(num_tokens) - len(prefix.pages))
        if extra > self.num_free - reused_free:
            return False
        for page in prefix.pages:
            self._hold(page)
        self._tables[request_id] = list(prefix.pages)
        self._chains[request_id] = list(prefix.hashes)
        return self.ensure(request_id, num_tokens)

    def commit(
        self,
        request_id: str,
        num_computed: int,
        token_at: Callable[[int, int], list[int]],
        extra: bytes = b"",
    ) -> None:
        """Cache the request's full blocks whose KV is computed (slots below `num_computed`).
        Called for every running request every step, so a step that fills no block returns
        before any other work; each block is hashed once, when it fills."""
        if not self.enable_caching:
            return
        chain = self._chains.setdefault(request_id, [])
        table = self.table(request_id)
        bs = self.block_size
        first, stop = len(chain), min(num_computed // bs, len(table))
        if stop <= first:
            return
        tokens = token_at(first * bs, stop * bs)  # every newly full block in one slice
        hashes = chain_hashes(chain[-1] if chain else None, tokens, bs, extra)
        for page, h in zip(table[first:stop], hashes, strict=True):
            chain.append(h)
            if h not in self._cached and page not in self._hash_of:
                self._cached[h] = page
                self._hash_of[page] = h

    # --- holding and releasing -------------------------------------------------------------

    def extra_blocks_for(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_needed(num_tokens) - len(self.table(request_id)))

    def ensure(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold `num_tokens` slots; all or nothing.  Called for every
        running request every step: a table that holds them already returns at once."""
        table = self._tables.get(request_id)
        if table is not None and len(table) * self.block_size >= num_tokens:
            return True
        extra = self.extra_blocks_for(request_id, num_tokens)
        if extra > self.num_free:
            return False
        table = self._tables.setdefault(request_id, [])
        table.extend(self._take() for _ in range(extra))
        return True

    def free(self, request_id: str) -> int:
        """Release every page of the request; the number of pages it held.  The tail is
        released first, so that a shared head outlives it in the cache."""
        table = self._tables.pop(request_id, [])
        self._chains.pop(request_id, None)
        for page in reversed(table):
            self._release(page)
        return len(table)

    def _take(self) -> int:
        """A free page for new KV: evicts what it cached."""
        page, _ = self._free.popitem(last=False)
        self._refs[page] = 1
        h = self._hash_of.pop(page, None)
        if h is not None:
            del self._cached[h]
            self._num_cached_free -= 1
        return page

    def _hold(self, page: int) -> None:
        if self._refs[page] == 0:
            del self._free[page]
            self._num_cached_free -= page in self._hash_of
        self._refs[page] += 1

    def _release(self, page: int) -> None:
        assert self._refs[page] > 0, f"page {page} released more often than held"
        self._refs[page] -= 1
        if self._refs[page]:
            return
        self._free[page] = None
        if page in self._hash_of:
            self._num_cached_free += 1
        else:
            self._free.move_to_end(page, last=False)  # it caches nothing: take it first

    # --- recovery --------------------------------------------------------------------------

    def drop_cache(self) -> None:
        """Forget every cached block (the executor's KV is gone, e.g. after a crash); pages held
        by requests stay held."""
        self._cached.clear()
        self._hash_of.clear()
        self._chains.clear()
        self._num_cached_free = 0

    def reset(self) -> None:
        """Every page free and nothing cached, as at start-up."""
        self.drop_cache()
        self._tables.clear()
        self._refs = [0] * self.num_blocks
        self._free = OrderedDict.fromkeys(range(self.num_blocks))

    # --- checks ----------------------------------------------------------------------------

    def check(self) -> None:
        """Raise AssertionError if any page is lost, free twice, or counted wrongly."""
        held = [b for table in self._tables.values() for b in table]
        holders = [0] * self.num_blocks
        for page in held:
            holders[page] += 1
        assert holders == self._refs, "a reference count differs from the number of holders"
        for table in self._tables.values():
            assert len(table) == len(set(table)), "a page is listed twice in one table"
        assert not set(held) & set(self._free), "a page is both free and held"
        assert len(set(held)) + len(self._free) == self.num_blocks, "pages lost or invented"
        assert all(self._hash_of.get(p) == h for h, p in self._cached.items()), "cache mismatch"
        assert len(self._hash_of) == len(self._cached), "a page cached under two hashes"
        cached_free = sum(1 for p in self._free if p in self._hash_of)
        assert cached_free == self._num_cached_free, "cached free pages miscounted"

    def check_idle(self) -> None:
        """Raise AssertionError if a page is held while no request runs; cached pages are fine."""
        assert not self._tables and self.num_used == 0, (
            f"{self.num_used} pages held with no request running (cached: {self.num_cached})"
        )
