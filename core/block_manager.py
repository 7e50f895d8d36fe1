"""Page accounting for the paged KV cache: which request owns which pages.

The block manager only counts; the pages themselves are tensors in the executor.  Every page is
either free or owned by exactly one request, and a request's pages are returned all at once.
"""

from __future__ import annotations

from collections import deque

from memstep.core.shapes import cdiv


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def owners(self) -> list[str]:
        return list(self._tables)

    def extra_blocks_for(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_needed(num_tokens) - len(self.table(request_id)))

    def can_hold(self, request_id: str, num_tokens: int) -> bool:
        return self.extra_blocks_for(request_id, num_tokens) <= self.num_free

    def ensure(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold `num_tokens` slots; all or nothing."""
        extra = self.extra_blocks_for(request_id, num_tokens)
        if extra > self.num_free:
            return False
        table = self._tables.setdefault(request_id, [])
        table.extend(self._free.popleft() for _ in range(extra))
        return True

    def free(self, request_id: str) -> int:
        """Return every page of the request; the number of pages freed."""
        table = self._tables.pop(request_id, [])
        self._free.extend(table)
        return len(table)

    def check(self) -> None:
        """Raise AssertionError if any page is owned twice or lost."""
        owned = [b for table in self._tables.values() for b in table]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert not set(owned) & set(self._free), "a page is both free and owned"
        assert len(owned) + len(self._free) == self.num_blocks, "pages lost or invented"
        assert len(set(self._free)) == len(self._free), "a page is free twice"
