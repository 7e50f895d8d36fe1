"""Continuous batching: which requests run this step, and how many tokens each feeds.

Running requests go first (decodes, then the rest of chunked prefills), then waiting ones join
while `max_num_seqs` and `max_num_batched_tokens` allow, each starting after the longest prefix
whose pages the prefix cache holds (those tokens cost no budget).  When pages run out the newest
running request is preempted by recompute: its pages are released and it waits to be prefilled
again (its full blocks stay cached, so it may reuse them).
"""

from __future__ import annotations

from collections import deque

import attrs

from memstep.core.block_manager import BlockManager, Prefix
from memstep.core.config import EngineConfig
from memstep.core.request import Request, Status
from memstep.core.spec_threshold import SpecThreshold


@attrs.define
class Scheduled:
    request: Request
    num_tokens: int  # tokens of the request fed this step (excluding drafts)
    num_drafts: int = 0  # lookahead slots reserved for speculative drafts

    @property
    def samples(self) -> bool:
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


@attrs.define
class StepBatch:
    kind: str
    seqs: list[Scheduled]
    preempted: list[Request] = attrs.Factory(list)  # sent back to the queue to make room
    is_decode: bool = False  # `is_decode(seqs)`, as the scheduler found it

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens + s.num_drafts for s in self.seqs)


class Scheduler:
    def __init__(
        self,
        cfg: EngineConfig,
        blocks: BlockManager,
        max_model_len: int,
        decode_lookahead: int = 0,
        spec_threshold: SpecThreshold | None = None,
    ):
        self.cfg = cfg
        self.spec_threshold = spec_threshold or SpecThreshold(cfg)  # picks each step's kind
        self.blocks = blocks
        self.max_model_len = max_model_len
        # slots past each decode that its pages should already cover, when pages are free: the
        # executor replays the next decode step ahead only where its KV slot is owned already
        self.decode_lookahead = decode_lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # by the scheduler, for room
        self.num_requeues = 0  # by executor losses (`requeue_all`)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Forget a finished or aborted request and free its pages."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.request_id)

    def schedule(self) -> StepBatch:
        budget = self.cfg.max_num_batched_tokens
        seqs: list[Scheduled] = []
        preempted: list[Request] = []
        decode = True  # every sequence so far feeds one token and samples it
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            uncomputed = req.num_uncomputed
            n = min(uncomputed, budget)
            if n == 0:
                break
            if not self._reserve(req, req.num_computed + n, preempted):
                continue
            seqs.append(Scheduled(req, n))
            budget -= n
            decode = decode and uncomputed == 1  # n is 1: the budget is over 0
        while self.waiting and len(self.running) < self.cfg.max_num_seqs and budget > 0:
            req = self.waiting[0]
            prefix = (
                Prefix()
                if req.scores_prompt
                else self.blocks.lookup(req.token_at(0, req.num_tokens))
            )
            hit = len(prefix.pages) * self.blocks.block_size
            n = min(req.num_tokens - hit, budget)
            if not self.blocks.allocate(req.request_id, prefix, hit + n):
                break
            self.waiting.popleft()
            req.admit(hit)
            self.running.append(req)
            seqs.append(Scheduled(req, n))
            budget -= n
            decode = decode and n == 1 and hit + n == req.num_tokens
        decode = decode and bool(seqs)
        kind = self.spec_threshold.kind_for(len(seqs), decode)
        if kind == "spec":
            for s in seqs:
                s.num_drafts = self._draft_slots(s)
        elif self.decode_lookahead:
            self._reserve_lookahead(seqs)
        return StepBatch(kind, seqs, preempted, decode)

    def _reserve_lookahead(self, seqs: list[Scheduled]) -> None:
        """Best effort, after every step's own pages: pages for `decode_lookahead` slots past
        each sequence that samples (a decode, a prompt's last chunk), never preempting for them
        (a page short only loses the replay ahead)."""
        for s in seqs:
            req = s.request
            if s.samples:
                wanted = min(req.num_tokens + self.decode_lookahead, self.max_model_len)
                self.blocks.ensure(req.request_id, wanted)

    def _reserve(self, req: Request, num_tokens: int, preempted: list[Request]) -> bool:
        """Pages for `num_tokens` of `req`, preempting the newest running requests if needed."""
        while not self.blocks.ensure(req.request_id, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, cause: str = "preemption") -> None:
        self.running.remove(req)
        self.blocks.free(req.request_id)
        req.preempt(cause)
        if cause == "preemption":
            self.num_preemptions += 1
        else:
            self.num_requeues += 1
        self.waiting.appendleft(req)

    def requeue_all(self) -> tuple[int, int]:
        """Every running request back to the front of the queue, in order, its pages freed: a
        lost executor took their KV cache with it.  Returns (requests, tokens to recompute)."""
        running = list(self.running)
        for req in reversed(running):
            self._preempt(req, "recovery")
        return len(running), sum(req.num_tokens for req in running)

    def use_pages(self, blocks: BlockManager, decode_lookahead: int) -> None:
        """The KV pages of a new executor (no request holds any: `requeue_all` came first)."""
        self.blocks, self.decode_lookahead = blocks, decode_lookahead

    def _draft_slots(self, s: Scheduled) -> int:
        req = s.request
        if not (s.samples and req.is_decoding):
            return 0
        left = min(
            req.params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens
        )
        k = max(0, min(req.draft_length or self.cfg.num_speculative_tokens, left - 1))
        slots = self.cfg.draft_slots(k)  # a tree's nodes, a chain's k
        if k and not self.blocks.ensure(req.request_id, req.num_tokens + slots):
            return 0
        return k


def is_decode(seqs: list[Scheduled]) -> bool:
    """Every sequence decodes (one token fed, sampled): a step whose cost is a decode step's."""
    return bool(seqs) and all(s.num_tokens == 1 and s.samples for s in seqs)
