"""Speculative steps over a draft tree (EAGLE-2 style, `speculative_tree`).

The head drafts a static tree (`core/spec_tree.py`): each node's children are its top
candidates after it. The target reads the whole tree in one forward, each node at its tree's
start plus its depth and attending the context and its ancestors only (`TreeTokens`,
`attention.tree_fields`). Acceptance walks down from the root: a node's children are tried in
turn against the target's distribution at the node, each kept with probability r(child) /
sum(r), where r starts as that distribution and loses the mass of each child rejected (the
recursive rejection sampling of SpecInfer and EAGLE-2 for deterministic drafts, which is
sampling from the target itself); when every child is rejected the token is drawn from what
is left. With a greedy target that is following its argmax, so the output is plain greedy
decoding's. The accepted path's K/V rows are then moved to the positions they hold, so that no
row of a rejected branch stays inside the sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from memstep.events.plan import SeqPlan, SeqResult, StepPlan
from memstep.executors.cpu.threads import small_work
from memstep.executors.model.kv_cache import KvCaches, move_slots, slot_of
from memstep.executors.runtime.batch_builder import TreeTokens
from memstep.executors.runtime.random_stream import ACCEPT, SAMPLE, SIBLING, uniform
from memstep.executors.runtime.sampler import Row, inverse_cdf, top_logprobs
from memstep.executors.spec.proposers import DraftTree

if TYPE_CHECKING:
    from memstep.executors.spec.decoder import SpecDecoder


def run_tree(
    dec: SpecDecoder, kv: KvCaches, plan: StepPlan
) -> tuple[list[SeqResult], torch.Tensor]:
    """`SpecDecoder.run` with draft trees: propose, verify in one forward, accept, keep the
    accepted path's K/V and hidden states where a chain's would be."""
    assert dec.eagle is not None
    for seq in plan.seqs:
        if seq.start_pos == 0 or seq.params:
            dec.forget(seq.request_id)  # as `SpecDecoder.run`: the draft state starts afresh
    spec_seqs = [s for s in plan.seqs if s.samples and s.num_drafts > 0 and len(s.token_ids) == 1]
    trees: dict[str, DraftTree] = {}
    if spec_seqs:
        with small_work(dec.on_cpu):
            drafted = dec.eagle.propose_tree(
                spec_seqs, [s.num_drafts for s in spec_seqs], dec.cfg.speculative_tree
            )
        trees = {s.request_id: t for s, t in zip(spec_seqs, drafted, strict=True) if t}
    feeds = [(s, _fed(s, trees.get(s.request_id))) for s in plan.seqs]
    hidden, last_rows = dec.forward(feeds)
    owners = [(s, last) for (s, _), last in zip(feeds, last_rows, strict=True) if s.samples]
    rows_idx: list[int] = []
    sample_rows: list[Row] = []
    for seq, last in owners:
        tree = trees.get(seq.request_id, DraftTree([], (-1,)))
        rows_idx.extend(range(last - len(tree.parents) + 1, last + 1))
        sample_rows.extend(_rows(dec, seq, tree))
    h = hidden[rows_idx]
    if not owners:
        return [], h
    logits = dec.target.logits(h, dec.sampler.logits_out(len(rows_idx)))
    raw = dec.sampler.keep_raw(logits) if any(r.params.logprobs for r in sample_rows) else None
    dec.sampler.constrain(logits, sample_rows)
    greedy = all(r.params.is_greedy and not r.params.has_penalties for r in sample_rows)
    probs = None if greedy else dec.sampler.distribution(logits, sample_rows)
    choices = logits.argmax(dim=-1).tolist() if greedy else []
    results, kept = [], []
    moves: tuple[list[int], list[int]] = ([], [])
    offset = 0
    for seq, last in owners:
        tree = trees.get(seq.request_id, DraftTree([], (-1,)))
        n = len(tree.parents)
        if probs is None:
            tokens, path = accept_tree_greedy(choices[offset : offset + n], tree)
        else:
            rows = sample_rows[offset : offset + n]
            tokens, path = accept_tree(probs[offset : offset + n], rows, tree, dec.spec)
        logprobs = []
        params = sample_rows[offset].params
        if raw is not None and params.logprobs:
            own = raw[[offset + node for node in [0, *path]]]
            logprobs = top_logprobs(own, tokens, params.logprobs, in_place=True)
        results.append(SeqResult(seq.request_id, tokens, logprobs, len(tree.tokens), len(path)))
        first = last - n + 1
        keep_path(seq, path, hidden, first, moves, dec.cfg.block_size)
        kept.append(dec.eagle.kept(seq, first, tokens))
        offset += n
    if moves[0]:
        device = hidden.device
        move_slots(kv, *(torch.tensor(m, dtype=torch.long, device=device) for m in moves))
    with small_work(dec.on_cpu):
        dec.eagle.keep(kept, hidden)
    return results, h


def _fed(seq: SeqPlan, tree: DraftTree | None) -> list[int]:
    if tree is None:
        return seq.token_ids
    return TreeTokens(seq.token_ids + tree.tokens, tree.parents)


def _rows(dec: SpecDecoder, seq: SeqPlan, tree: DraftTree) -> list[Row]:
    """Each node's sampling row: the token after it, at its depth, after its path's tokens."""
    req = dec.requests[seq.request_id]
    base = len(req.tokens)
    rows, paths = [], [[]]  # type: list[Row], list[list[int]]
    for node in range(1, len(tree.parents)):
        paths.append([*paths[tree.parents[node]], tree.token(node)])
    for path in paths:
        rows.append(req.row(base + len(path), req.tokens + path))
    return rows


def keep_path(
    seq: SeqPlan,
    path: list[int],
    hidden: torch.Tensor,
    first: int,
    moves: tuple[list[int], list[int]],
    block_size: int,
) -> None:
    """The accepted path's nodes to the rows a chain's would hold: their hidden states (rows
    from `first`, the root's) in place, their K/V slots into `moves` (from, to)."""
    for depth, node in enumerate(path, start=1):
        if node == depth:
            continue
        hidden[first + depth] = hidden[first + node]
        table, start = seq.block_table, seq.start_pos
        moves[0].append(slot_of(table, start + node, block_size))
        moves[1].append(slot_of(table, start + depth, block_size))


def accept_tree_greedy(choices: list[int], tree: DraftTree) -> tuple[list[int], list[int]]:
    """Tokens appended and the accepted path's nodes where each node's target is one-hot at
    `choices[node]`: down the child that is the choice, while there is one."""
    kids = tree.children()
    node, tokens, path = 0, [], []  # type: int, list[int], list[int]
    while True:
        want = choices[node]
        tokens.append(want)
        child = next((c for c in kids[node] if tree.token(c) == want), None)
        if child is None:
            return tokens, path
        path.append(child)
        node = child


def accept_tree(
    p: torch.Tensor, rows: list[Row], tree: DraftTree, spec
) -> tuple[list[int], list[int]]:
    """Tokens appended and the accepted path's nodes. p: [nodes + 1, V] the target's
    distribution after each node; rows: each node's sampling row (seed and position); the
    `spec` kind's `residual` [2, V] is the workspace of what is left of a node's distribution
    and its running sum."""
    residual = spec.held["residual"]
    dist, scratch = residual[0:1], residual[1:2]
    kids = tree.children()
    node, tokens, path = 0, [], []  # type: int, list[int], list[int]
    while True:
        seed, pos = rows[node].seed, rows[node].position
        dist[0].copy_(p[node])
        child = None
        for i, c in enumerate(kids[node]):
            d = tree.token(c)
            u = uniform(seed, pos, ACCEPT if i == 0 else SIBLING + i)
            if u * float(dist.sum()) < float(dist[0, d]):
                child = c
                break
            dist[0, d] = 0.0  # rejected: its mass goes, the next sibling is tried against the rest
        if child is None:
            if float(dist.sum()) <= 0.0:
                dist[0].copy_(p[node])
            u_t = torch.tensor([uniform(seed, pos, SAMPLE)])
            tokens.append(inverse_cdf(dist, u_t, scratch)[0])
            return tokens, path
        tokens.append(tree.token(child))
        path.append(child)
        node = child
