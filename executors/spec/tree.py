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

from collections.abc import Callable

import torch

from memstep.core.config import EngineConfig
from memstep.events.plan import SeqPlan, SeqResult, StepPlan
from memstep.executors.cpu.threads import small_work
from memstep.executors.model.kv_cache import KvCaches, move_slots, slot_of
from memstep.executors.model.llama import LlamaModel
from memstep.executors.runtime.batch_builder import Feed, TreeTokens
from memstep.executors.runtime.random_stream import ACCEPT, SAMPLE, SIBLING, uniform
from memstep.executors.runtime.running_requests import RunningRequests
from memstep.executors.runtime.sampler import Row, Sampler, inverse_cdf, top_logprobs
from memstep.executors.spec.proposers import DraftTree, EagleProposer
from memstep.states.kinds import Spec


class TreeStep:
    """Runs `spec` steps with draft trees; holds what `SpecDecoder` hands it, owns nothing
    between steps (the head's state lives in the `spec` kind, as for chains)."""

    def __init__(
        self,
        cfg: EngineConfig,
        target: LlamaModel,
        forward: Callable[[list[Feed]], tuple[torch.Tensor, list[int]]],
        requests: RunningRequests,
        sampler: Sampler,
        spec: Spec,
        eagle: EagleProposer,
        kv: KvCaches,
    ):
        self.cfg, self.target, self.forward, self.requests = cfg, target, forward, requests
        self.sampler, self.spec, self.eagle, self.kv = sampler, spec, eagle, kv
        self.on_cpu = target.w["embed"].device.type == "cpu"

    def run(self, plan: StepPlan) -> tuple[list[SeqResult], torch.Tensor]:
        """`SpecDecoder.run` with draft trees: propose, verify in one forward, accept, keep the
        accepted path's K/V and hidden states where a chain's would be."""
        admitted = plan.admitted_ids
        for seq in plan.seqs:
            if seq.request_id in admitted:
                self.spec.forget(seq.request_id)  # as `SpecDecoder.run`: the head starts afresh
        trees = self._propose(plan.seqs)
        feeds = [(s, _fed(s, trees.get(s.request_id))) for s in plan.seqs]
        hidden, last_rows = self.forward(feeds)
        owners = [(s, last) for (s, _), last in zip(feeds, last_rows, strict=True) if s.samples]
        rows_idx: list[int] = []
        sample_rows: list[Row] = []
        for seq, last in owners:
            tree = trees.get(seq.request_id, NO_TREE)
            rows_idx.extend(range(last - len(tree.parents) + 1, last + 1))
            sample_rows.extend(self._rows(seq, tree))
        h = hidden[rows_idx]
        if not owners:
            return [], h
        results = self._accept(owners, trees, hidden, h, sample_rows)
        return results, h

    def _propose(self, seqs: list[SeqPlan]) -> dict[str, DraftTree]:
        spec_seqs = [s for s in seqs if s.samples and s.num_drafts > 0 and len(s.token_ids) == 1]
        if not spec_seqs:
            return {}
        with small_work(self.on_cpu):
            drafted = self.eagle.propose_tree(
                spec_seqs, [s.num_drafts for s in spec_seqs], self.cfg.speculative_tree
            )
        return {s.request_id: t for s, t in zip(spec_seqs, drafted, strict=True) if t}

    def _rows(self, seq: SeqPlan, tree: DraftTree) -> list[Row]:
        """Each node's sampling row: the token after it, at its depth, after its path's
        tokens."""
        req = self.requests[seq.request_id]
        base = len(req.tokens)
        paths: list[list[int]] = [[]]
        for node in range(1, len(tree.parents)):
            paths.append([*paths[tree.parents[node]], tree.token(node)])
        return [req.row(base + len(path), req.tokens + path) for path in paths]

    def _accept(
        self,
        owners: list[tuple[SeqPlan, int]],
        trees: dict[str, DraftTree],
        hidden: torch.Tensor,
        h: torch.Tensor,
        sample_rows: list[Row],
    ) -> list[SeqResult]:
        """Each sampling sequence's tokens down its tree; the accepted paths' K/V and hidden
        states moved, then kept for the head."""
        sampler = self.sampler
        logits = self.target.logits(h, sampler.logits_out(len(sample_rows)))
        raw = sampler.keep_raw(logits) if any(r.params.logprobs for r in sample_rows) else None
        sampler.constrain(logits, sample_rows)
        greedy = all(r.params.takes_argmax for r in sample_rows)
        probs = None if greedy else sampler.distribution(logits, sample_rows)
        choices = logits.argmax(dim=-1).tolist() if greedy else []
        results, kept = [], []
        moves: tuple[list[int], list[int]] = ([], [])
        offset = 0
        for seq, last in owners:
            tree = trees.get(seq.request_id, NO_TREE)
            n = len(tree.parents)
            rows = sample_rows[offset : offset + n]
            if probs is None:
                tokens, path = accept_tree_greedy(choices[offset : offset + n], tree)
            else:
                tokens, path = accept_tree(probs[offset : offset + n], rows, tree, self.spec)
            logprobs = []
            if raw is not None and rows[0].params.logprobs:
                own = raw[[offset + node for node in [0, *path]]]
                logprobs = top_logprobs(own, tokens, rows[0].params.logprobs, in_place=True)
            results.append(SeqResult(seq.request_id, tokens, logprobs, len(tree.tokens), len(path)))
            keep_path(seq, path, hidden, last - n + 1, moves, self.cfg.block_size)
            kept.append(self.eagle.kept(seq, last - n + 1, tokens))
            offset += n
        if moves[0]:
            device = hidden.device
            move_slots(self.kv, *(torch.tensor(m, dtype=torch.long, device=device) for m in moves))
        with small_work(self.on_cpu):
            self.eagle.keep(kept, hidden)
        return results


NO_TREE = DraftTree([], (-1,))  # a sequence that drafts nothing: its root alone


def _fed(seq: SeqPlan, tree: DraftTree | None) -> list[int]:
    if tree is None:
        return seq.token_ids
    return TreeTokens(seq.token_ids + tree.tokens, tree.parents)


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
