"""A decode step replayed before its plan came, and the test of whether the plan is that step.

After a decode step the CUDA executor replays the next one at once: the same sequences, one
position on, each fed the token just sampled (still on the device). The core meanwhile records
the step and plans the next; if that plan is exactly the step replayed, its hidden states are
ready, otherwise they are dropped and the plan runs as usual. Either way the tokens are those
of running every step when its plan comes (tests/executors/test_gpu.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from memstep.executors.batch_builder import Feed
from memstep.executors.kv_cache import slot_of
from memstep.executors.sampler import HostCopy


@attrs.frozen
class Ahead:
    """Which sequences the replay ran, at which positions and KV slots, fed which tokens."""

    request_ids: list[str]
    starts: list[int]
    slots: list[int]
    tokens: HostCopy  # the device's values: a row settled on the host later is still negative

    def matches(self, feeds: Sequence[Feed], block_size: int) -> bool:
        """The plan's step is this one: the same sequences in the same order, at the same
        positions and KV slots, fed the same tokens."""
        if len(feeds) != len(self.request_ids):
            return False
        fed = self.tokens.values()
        for (seq, tokens), rid, start, slot, tok in zip(
            feeds, self.request_ids, self.starts, self.slots, fed, strict=True
        ):
            if seq.request_id != rid or seq.start_pos != start or list(tokens) != [tok]:
                return False
            if start // block_size >= len(seq.block_table):
                return False
            if slot_of(seq.block_table, start, block_size) != slot:
                return False
        return True
