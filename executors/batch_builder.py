"""Turn a step plan's sequences into one flattened `ForwardBatch` for the model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from memstep.events.plan import SeqPlan
from memstep.executors.attention import SHORT_QUERY, AttnGroup, ForwardBatch, build_group

Feed = tuple[SeqPlan, Sequence[int]]  # a sequence and the tokens it feeds this step

PREFILL_GROUP_TOKENS = 2048  # CUDA: most queries of equal prefill chunks in one attention call


def slot_of(table: Sequence[int], position: int, block_size: int) -> int:
    """The flat KV slot of `position` in a sequence whose pages are `table`."""
    return table[position // block_size] * block_size + position % block_size


def slots_for(table: list[int], start: int, n: int, block_size: int) -> list[int]:
    return [slot_of(table, p, block_size) for p in range(start, start + n)]


def build_batch(
    feeds: list[tuple[SeqPlan, list[int]]],
    block_size: int,
    device: torch.device,
    split_decodes: bool | None = None,
) -> tuple[ForwardBatch, list[int]]:
    """`feeds` pairs each sequence with the tokens it feeds (its plan's, plus any drafts).
    `split_decodes` (default: on CUDA) keeps one-token queries in a group of their own, for
    the paged decode kernel, apart from other short queries: one 3-token prompt tail beside
    500 decodes would otherwise make a padded group that gathers all 500 sequences' KV
    (~1 GiB a layer, 8B model) in plain torch.

    Returns the batch and, per sequence, the row of its last fed token."""
    if split_decodes is None:
        split_decodes = device.type == "cuda"
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    short: list[tuple[int, int, int, list[int]]] = []
    decodes: list[tuple[int, int, int, list[int]]] = []
    equal: dict[tuple[int, int], list[tuple[int, int, int, list[int]]]] = {}
    groups: list[AttnGroup] = []
    last_rows: list[int] = []
    for seq, tokens in feeds:
        start_row, n = len(ids), len(tokens)
        ids.extend(tokens)
        positions.extend(range(seq.start_pos, seq.start_pos + n))
        slots.extend(slots_for(seq.block_table, seq.start_pos, n, block_size))
        last_rows.append(start_row + n - 1)
        item = (start_row, n, seq.start_pos + n, seq.block_table)
        if n == 1 and split_decodes:
            decodes.append(item)
        elif n <= SHORT_QUERY:
            short.append(item)
        elif device.type == "cuda":
            equal.setdefault((n, seq.start_pos + n), []).append(item)
        else:
            groups.append(build_group(*map(lambda x: [x], item), block_size, device))
    # CUDA: equal chunks (same length, same context) share one attention call, up to
    # PREFILL_GROUP_TOKENS queries, so a step of many short prompts is not launch-bound. The CPU
    # keeps one call per chunk: its results then never depend on what else is in the batch.
    for (n, _), items in equal.items():
        per_group = max(1, PREFILL_GROUP_TOKENS // n)
        for i in range(0, len(items), per_group):
            cols = (list(col) for col in zip(*items[i : i + per_group], strict=True))
            groups.append(build_group(*cols, block_size, device))
    for items in (short, decodes):  # decodes first, then other short queries, then prefills
        if items:
            starts, q_lens, ctx, tables = (list(col) for col in zip(*items, strict=True))
            groups.insert(0, build_group(starts, q_lens, ctx, tables, block_size, device))
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        groups=tuple(groups),
        num_tokens=len(ids),
    )
    return batch, last_rows
