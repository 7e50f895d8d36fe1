"""A decode step replayed before its plan came, and which of the plan's sequences it ran.

After a step whose sequences sampled, the CUDA executor replays the decode step after it at
once: those sequences, one position on, each fed the token just sampled (still on the device).
The core meanwhile records the step and plans the next. A sequence the plan feeds exactly as
the replay did (same position, KV slot and token) takes its hidden state from the replay; the
plan's other sequences (new prompt chunks, a sequence the replay fed otherwise) run as usual,
so a mixed step computes only its chunks once its plan comes. A sequence the plan leaves out
(finished, preempted) wasted one row: its KV write lies past its computed tokens, in a page it
owned when the replay ran.

A row taken was computed by the decode graph at the replay's batch size, where without the
replay a mixed step computes it in one forward beside its chunks: the same values within the
dtype's rounding, not bit for bit by construction (GEMMs of other shapes may round otherwise).
On SmolLM2 every token came out the same either way, in bfloat16 and float32
(tests/executors/cuda/test_gpu.py). Which rows a plan takes depends only on the plans and the
tokens, so a replay of a recorded run takes the same ones (docs/benchmarks.md, "Figures behind
the code's constants").
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from memstep.executors.model.kv_cache import slot_of
from memstep.executors.runtime.batch_builder import Feed
from memstep.executors.runtime.sampler import HostCopy


@attrs.frozen
class Ahead:
    """Which sequences the replay ran, at which positions and KV slots, fed which tokens."""

    request_ids: list[str]
    starts: list[int]
    slots: list[int]
    tokens: HostCopy  # the device's values: a row settled on the host later is still negative

    def rows(self, feeds: Sequence[Feed], block_size: int) -> list[int | None]:
        """Each feed's row of the replay, or None where the replay did not run that feed: the
        same sequence fed one token at the same position and KV slot, that token the one fed."""
        index = {rid: i for i, rid in enumerate(self.request_ids)}
        fed = self.tokens.values()
        rows: list[int | None] = []
        for seq, tokens in feeds:
            i = index.get(seq.request_id)
            start, table = seq.start_pos, seq.block_table
            same = (
                i is not None
                and len(tokens) == 1
                and start == self.starts[i]
                and tokens[0] == fed[i]
                and start // block_size < len(table)
                and slot_of(table, start, block_size) == self.slots[i]
            )
            rows.append(i if same else None)
        return rows
