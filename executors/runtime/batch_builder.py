"""Turn a step plan's sequences into one flattened `ForwardBatch` for the model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from memstep.core.spec_tree import tree_depths
from memstep.events.plan import SeqPlan
from memstep.executors.model.attention import (
    SHORT_QUERY,
    AttnGroup,
    ForwardBatch,
    PackedGroup,
    build_group,
    build_packed,
)
from memstep.executors.model.kv_cache import slots_for

Feed = tuple[SeqPlan, Sequence[int]]  # a sequence and the tokens it feeds this step


class TreeTokens(list[int]):
    """A feed's tokens that are a draft tree (`core/spec_tree.py`): its root (the token fed)
    and draft nodes, each after its parent; `parents[i]` is node i's (-1 for the root). A node
    sits at its tree's start position plus its depth, its K/V in the slot of its number past
    that start, and attends the context and its ancestors only (`attention.tree_fields`)."""

    def __init__(self, tokens: Sequence[int], parents: tuple[int, ...]):
        super().__init__(tokens)
        assert len(parents) == len(tokens) and parents[0] == -1
        self.parents = parents


PACKED_KEYS = 16384  # context keys one packed attention call gathers, at most (or one context)


def packed_parts(items: list[tuple[int, int, int, list[int]]]) -> list[list]:
    """`items` in runs of at most PACKED_KEYS context keys (a longer context alone): each run is
    one packed attention call, whose gathered keys and values are then bounded whatever the
    step holds (1,024 verifies at 2,048 tokens of context would gather 8 GiB a layer of an 8B
    model in one call)."""
    parts: list[list] = []
    keys = 0
    for item in items:
        ctx = item[2]
        if not parts or keys + ctx > PACKED_KEYS:
            parts.append([])
            keys = 0
        parts[-1].append(item)
        keys += ctx
    return parts


def build_batch(
    feeds: list[tuple[SeqPlan, list[int]]],
    block_size: int,
    device: torch.device,
    split_decodes: bool | None = None,
    packed: bool | None = None,
) -> tuple[ForwardBatch, list[int]]:
    """`feeds` pairs each sequence with the tokens it feeds (its plan's, plus any drafts).
    `split_decodes` (default: on CUDA) keeps one-token queries in a group of their own, for
    the paged decode kernel, apart from other short queries: one 3-token prompt tail beside
    500 decodes would otherwise make a padded group that gathers all 500 sequences' KV
    (~1 GiB a layer, 8B model) in plain torch. `packed` (default: on CUDA, which implies
    `split_decodes`) puts every query but the decodes in one `PackedGroup`.

    Returns the batch and, per sequence, the row of its last fed token."""
    per_query = device.type == "cpu"  # the CPU backend attends longer queries row by row
    if packed is None:
        packed = device.type == "cuda"
    if split_decodes is None:
        split_decodes = device.type == "cuda" or packed
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    short: list[tuple[int, int, int, list[int]]] = []
    decodes: list[tuple[int, int, int, list[int]]] = []
    groups: list[AttnGroup | PackedGroup] = []
    others: list[tuple[int, int, int, list[int]]] = []  # packed: every query but the decodes
    last_rows: list[int] = []
    trees: list[tuple[int, int, int, list[int]]] = []
    parents: list[tuple[int, ...]] = []
    for seq, tokens in feeds:
        start_row, n = len(ids), len(tokens)
        ids.extend(tokens)
        slots.extend(slots_for(seq.block_table, seq.start_pos, n, block_size))
        last_rows.append(start_row + n - 1)
        item = (start_row, n, seq.start_pos + n, seq.block_table)
        if isinstance(tokens, TreeTokens) and n > 1:
            positions.extend(seq.start_pos + depth for depth in tree_depths(tokens.parents))
            trees.append(item)
            parents.append(tokens.parents)
            continue
        positions.extend(range(seq.start_pos, seq.start_pos + n))
        if n == 1 and split_decodes:
            decodes.append(item)
        elif packed:
            others.append(item)
        elif n <= SHORT_QUERY:
            short.append(item)
        else:  # one call per chunk: its results never depend on what else is in the batch
            one = (*map(lambda x: [x], item), block_size, device, per_query)
            groups.append(build_group(*one))
    for part in packed_parts(others):
        cols = (list(col) for col in zip(*part, strict=True))
        groups.append(build_packed(*cols, block_size, device))
    for items in (short, decodes):  # decodes first, then other short queries, then prefills
        if items:
            starts, q_lens, ctx, tables = (list(col) for col in zip(*items, strict=True))
            group = build_group(starts, q_lens, ctx, tables, block_size, device, per_query)
            groups.insert(0, group)
    if trees:  # one group, masked: never packed nor padded into the short queries' group
        starts, q_lens, ctx, tables = (list(col) for col in zip(*trees, strict=True))
        tree = build_group(starts, q_lens, ctx, tables, block_size, device, per_query, parents)
        groups.append(tree)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        groups=tuple(groups),
        num_tokens=len(ids),
    )
    return batch, last_rows
