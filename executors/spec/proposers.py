"""Draft proposers for speculative decoding: n-gram prompt lookup, a draft model, and an
EAGLE-style head over the target's hidden states.

Each returns, per sequence, up to k draft tokens; the draft model also the distribution each
was drawn from (the others propose deterministically: a one-hot distribution, `None`).
"""

from __future__ import annotations

import attrs
import torch

from memstep.core.spec_tree import tree_parents
from memstep.events.plan import SeqPlan
from memstep.executors.model.llama import LlamaModel
from memstep.executors.runtime.batch_builder import build_batch
from memstep.executors.runtime.random_stream import DRAFT
from memstep.executors.runtime.running_requests import RunningRequests
from memstep.executors.runtime.sampler import Sampler
from memstep.executors.spec.eagle_head import EagleHead
from memstep.states.kinds import Spec


def ngram_propose(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (longest n first)
    and propose the k tokens that followed it."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        pattern = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == pattern:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


class DraftModelProposer:
    """A smaller model with its own paged KV cache (the `spec` kind's `draft_kv` buffer), sharing
    the target's page tables.  `spec.draft_len[request]` counts tokens already in the draft KV;
    each step first feeds whatever the draft has not seen (catch-up after `no_spec` stretches or
    rejected drafts), then drafts k tokens one at a time."""

    def __init__(
        self,
        model: LlamaModel,
        spec: Spec,
        requests: RunningRequests,
        sampler: Sampler,
        block_size: int,
    ):
        self.model = model
        self.spec = spec
        self.requests = requests
        self.sampler = sampler
        self.block_size = block_size

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        draft_kv = self.spec.held["draft_kv"]
        return [(draft_kv[0, i], draft_kv[1, i]) for i in range(draft_kv.shape[1])]

    def propose(self, seqs: list[SeqPlan], ks: list[int]):
        """Draft tokens and the rows of draft probabilities (in the spec kind's buffer)."""
        spec = self.spec
        probs_buf = spec.held["draft_probs"]
        kv = self.kv()
        drafts: list[list[int]] = [[] for _ in seqs]
        feeds = []
        for seq in seqs:
            tokens = self.requests[seq.request_id].tokens
            seen = spec.draft_len.get(seq.request_id, 0)
            feeds.append(attrs.evolve(seq, start_pos=seen, token_ids=tokens[seen:]))
        active = list(range(len(seqs)))
        for j in range(max(ks, default=0)):
            active = [i for i in active if j < ks[i]]
            if not active:
                break
            batch_feeds = [(feeds[i], feeds[i].token_ids) for i in active]
            batch, last_rows = build_batch(batch_feeds, self.block_size, kv[0][0].device)
            hidden = self.model.forward(batch, kv)
            logits = self.model.logits(hidden[last_rows])
            rows = []
            for i in active:
                state = self.requests[seqs[i].request_id]
                history = state.tokens + drafts[i]
                rows.append(state.row(len(history), history))
            probs = self.sampler.distribution(logits, rows)
            picked = self.sampler.sample(probs, rows, stream=DRAFT)
            for r, i in enumerate(active):
                probs_buf[i, j].copy_(probs[r])
                drafts[i].append(picked[r])
                pos = feeds[i].start_pos + len(feeds[i].token_ids)
                spec.draft_len[seqs[i].request_id] = pos
                feeds[i] = attrs.evolve(feeds[i], start_pos=pos, token_ids=[picked[r]])
        return drafts, [probs_buf[i] for i in range(len(seqs))]


@attrs.frozen
class DraftTree:
    """A request's draft tree: `tokens` of nodes 1.. and every node's parent, the root's (the
    token fed) -1 first (`core/spec_tree.py`'s numbering)."""

    tokens: list[int]
    parents: tuple[int, ...]

    def token(self, node: int) -> int:
        return self.tokens[node - 1]

    def children(self) -> list[list[int]]:
        """Each node's children, best candidate first."""
        kids: list[list[int]] = [[] for _ in self.parents]
        for node in range(1, len(self.parents)):
            kids[self.parents[node]].append(node)
        return kids


@attrs.frozen
class Kept:
    """What a spec step keeps of one request for its EAGLE head: the rows of the step's hidden
    states from `first` on, one per token of `tokens`: the state and the token it chose, the
    pairs the head reads. The first `fed` of them are pairs within the tokens the step was fed
    (a prompt chunk's, for a head that reads the prompt); the rest are the tokens appended."""

    request_id: str
    first: int
    tokens: list[int]
    fed: int = 0

    @property
    def appended(self) -> int:
        return len(self.tokens) - self.fed


class EagleProposer:
    """Drafts from each request's last hidden state, held in the `spec` kind's
    `previous_hidden_states` (`keep`, after every spec step), and for a head with attention
    the keys and values of the pairs read since the request's state was last fresh
    (`draft_context`). A request without a fresh state (just admitted, or `spec` just
    re-entered) drafts nothing this step: its verify forward gives the state for the next, and
    its context starts again from there."""

    def __init__(self, head: EagleHead, spec: Spec, requests: RunningRequests):
        self.head = head
        self.spec = spec
        self.requests = requests

    def propose(self, seqs: list[SeqPlan], ks: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        inputs = self._inputs(seqs, ks)
        if inputs is None:
            return drafts
        who, hidden, tokens, context, rows, read = inputs
        proposed = self.head.draft_rows(hidden, tokens, max(ks), context, rows, read).tolist()
        for r, i in enumerate(who):
            drafts[i] = proposed[r][: ks[i]]
        return drafts

    def propose_tree(
        self, seqs: list[SeqPlan], ks: list[int], widths: tuple[int, ...]
    ) -> list[DraftTree | None]:
        """A draft tree of `widths` per sequence, cut at its depth `ks[i]` (a prefix of the
        deepest: `core/spec_tree.py`); None where it drafts nothing."""
        trees: list[DraftTree | None] = [None] * len(seqs)
        inputs = self._inputs(seqs, ks)
        if inputs is None:
            return trees
        who, hidden, tokens, context, rows, read = inputs
        parents = tree_parents(widths, max(ks))
        proposed = self.head.draft_tree(hidden, tokens, parents, context, rows, read).tolist()
        for r, i in enumerate(who):
            cut = tree_parents(widths, ks[i])
            trees[i] = DraftTree(proposed[r][: len(cut) - 1], cut)
        return trees

    def _inputs(self, seqs: list[SeqPlan], ks: list[int]):
        """Which sequences draft (a fresh state, k > 0), their states [B, H] and last tokens
        [B], the context and its rows and pairs read; None where none drafts."""
        who, rows, last = [], [], []
        for i, seq in enumerate(seqs):
            tokens = self.requests[seq.request_id].tokens
            row = self.spec.hidden_row(seq.request_id, len(tokens))
            if row is not None and ks[i] > 0:
                who.append(i)
                rows.append(row)
                last.append(tokens[-1])
        if not who:
            return None
        held = self.spec.held["previous_hidden_states"]
        device = held.device
        context, read = None, []
        if self.head.attn is not None:
            context = self.spec.held["draft_context"]
            read = [self.spec.context_of[seqs[i].request_id] for i in who]
        hidden = held[torch.tensor(rows, device=device)]
        return who, hidden, torch.tensor(last, device=device), context, rows, read

    def kept(self, seq: SeqPlan, first: int, tokens: list[int]) -> Kept:
        """What a step keeps of `seq`, whose rows from `first` on (of the step's hidden states)
        chose `tokens`: for a head that reads the prompt, a chunk of more than one token fed
        (a prompt's last chunk, or a preempted request's tokens again) gives a pair for each of
        its positions, the state there and the token after it."""
        fed = seq.token_ids
        if not self.head.reads_prompt or len(fed) == 1:
            return Kept(seq.request_id, first, tokens)
        return Kept(seq.request_id, first - len(fed) + 1, fed[1:] + tokens, len(fed) - 1)

    def keep(self, kept: list[Kept], hidden: torch.Tensor) -> None:
        """After a forward over `hidden` [rows, H]: hold each request's last state, and with
        attention write the keys of its new pairs into its context (from position 0 when its
        state was not fresh at this step's start; of more pairs than the context's window, the
        last window of them)."""
        fresh = [
            self.spec.hidden_row(k.request_id, len(self.requests[k.request_id].tokens)) is None
            for k in kept
        ]
        owners = [
            (k.request_id, len(self.requests[k.request_id].tokens) + k.appended) for k in kept
        ]
        last = torch.tensor([k.first + len(k.tokens) - 1 for k in kept], device=hidden.device)
        placed = self.spec.keep_hidden(owners, hidden[last])
        if self.head.attn is None:
            return
        window = self.head.attn.window
        rows, slots, picked, tokens, positions = [], [], [], [], []
        for k, row, was_fresh in zip(kept, placed, fresh, strict=True):
            if row is None:
                continue
            start = 0 if was_fresh else self.spec.context_of.get(k.request_id, 0)
            for j in range(max(0, len(k.tokens) - window), len(k.tokens)):
                rows.append(row)
                slots.append((start + j) % window)
                picked.append(k.first + j)
                tokens.append(k.tokens[j])
                positions.append(start + j)
            self.spec.context_of[k.request_id] = start + len(k.tokens)
        if not rows:
            return
        device = hidden.device
        self.head.write_pairs(
            hidden[torch.tensor(picked, device=device)],
            torch.tensor(tokens, device=device),
            torch.tensor(positions, device=device),
            self.spec.held["draft_context"],
            torch.tensor(rows, device=device),
            torch.tensor(slots, device=device),
        )
