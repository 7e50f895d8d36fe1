"""What the router sent where: prompts cut into blocks, hashed as a chain, remembered per replica.

The router tracks prefixes itself rather than reading each replica's prefix-cache hashes: it
needs no tokenizer and no new message, it knows a prompt's blocks the moment it routes it (a
published cache lags by a round trip, so a burst sharing a system prompt would scatter), and its
state is a function of its own log, so a replay rebuilds it exactly.  The price is that a
replica's evictions are invisible here: an entry is forgotten past `max_blocks` per replica
(least recently sent first), an approximation of the replica's own cache, as SGLang's router does.
"""

from __future__ import annotations

import collections
import hashlib
import json
from typing import Any

BLOCK_CHARS = 64  # a block: this many characters of the prompt (about 16 tokens of English)
MAX_BLOCKS_PER_REPLICA = 1 << 16
HASH_MASK = (1 << 63) - 1  # msgpack ints in the codec's range


def prompt_key(prompt: str | None, token_ids: list[int] | None, messages: Any) -> str:
    """The text a request's prefix is read from: its prompt, its token ids, or its messages."""
    if prompt is not None:
        return prompt
    if token_ids is not None:
        return " ".join(map(str, token_ids))
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


def block_hashes(key: str, block_chars: int = BLOCK_CHARS) -> list[int]:
    """Chained hashes of the whole blocks of `key`: each depends on every block before it."""
    hashes, parent = [], b""
    for start in range(0, len(key) - block_chars + 1, block_chars):
        chunk = key[start : start + block_chars].encode()
        digest = hashlib.blake2b(parent + chunk, digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little") & HASH_MASK)
        parent = digest
    return hashes


class PrefixIndex:
    """Per replica, the block hashes sent to it, least recently sent first (bounded)."""

    def __init__(self, num_replicas: int, max_blocks: int = MAX_BLOCKS_PER_REPLICA):
        self.max_blocks = max_blocks
        self.sent = [collections.OrderedDict[int, None]() for _ in range(num_replicas)]

    def matched(self, replica: int, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` were sent to `replica`."""
        held = self.sent[replica]
        count = 0
        for h in hashes:
            if h not in held:
                break
            count += 1
        return count

    def add(self, replica: int, hashes: list[int]) -> None:
        held = self.sent[replica]
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A lost replica's cache is gone with it."""
        self.sent[replica].clear()
