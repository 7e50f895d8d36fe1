"""Speculative decoding: propose drafts, verify them in one target forward, accept losslessly.

Acceptance is standard speculative sampling: draft d drawn from q is kept with probability
min(1, p(d) / q(d)); on rejection the token is drawn from max(0, p - q) renormalised; if every
draft is kept a bonus token is drawn from the next target distribution.  With a greedy target p
is one-hot, so the output equals non-speculative greedy decoding token for token.  Every random
draw is keyed by (seed, position, stream), so results do not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memstep.core.config import ConfigError, EngineConfig
from memstep.core.model_config import ModelConfig
from memstep.events.plan import SeqPlan, SeqResult, StepPlan
from memstep.executors.cpu.threads import small_work
from memstep.executors.model.kv_cache import KvCaches
from memstep.executors.model.llama import Backend, LlamaModel
from memstep.executors.model.weights import Weights
from memstep.executors.runtime.batch_builder import Feed
from memstep.executors.runtime.random_stream import ACCEPT, SAMPLE, uniform
from memstep.executors.runtime.running_requests import RunningRequests
from memstep.executors.runtime.sampler import Row, Sampler, inverse_cdf, top_logprobs
from memstep.executors.spec.eagle import head_path
from memstep.executors.spec.eagle_head import EagleHead
from memstep.executors.spec.proposers import DraftModelProposer, EagleProposer, Kept, ngram_propose
from memstep.executors.spec.tree import TreeStep
from memstep.states.kinds import Spec, draft_config


def draft_model(
    cfg: EngineConfig,
    target: ModelConfig,
    weights: Weights,
    dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    backend_of: Callable[..., Backend],
) -> LlamaModel | None:
    """The draft model of `speculative_method="draft"`: a model folder of its own, or the
    target's first layers over the target's own weights; None for other methods. `backend_of`:
    how a backend is picked (executors/process/assemble.py `pick_backend`)."""
    if cfg.speculative_method != "draft":
        return None
    dcfg = draft_config(cfg, target)
    if cfg.draft_model is not None:
        from memstep.core.model_source import resolve
        from memstep.executors.model.weights import load_weights

        weights = load_weights(
            resolve(cfg.draft_model, cfg.random_weights_seed), dcfg, dtype, device
        )
    # its cache is the spec kind's `draft_kv`, in the model's dtype; torch attends its rows
    backend = backend_of(device, dcfg, weights, dtype, decode_attention=False)
    return LlamaModel(dcfg, weights, max_len + cfg.num_speculative_tokens + 16, backend)


def eagle_head(cfg: EngineConfig, target: LlamaModel) -> EagleHead | None:
    """The EAGLE head of `speculative_method="eagle"`: `draft_model`'s .npz, or the one committed
    for smollm2; None for other methods."""
    if cfg.speculative_method != "eagle":
        return None
    path = head_path(cfg)
    if path is None or not path.is_file():
        raise ConfigError(f"no EAGLE head at {path}: `memstep train-draft --out PATH` makes one")
    mc = target.cfg
    kv_shape = (mc.num_kv_heads, mc.head_dim)
    positions = target.cos.shape[0]  # the target's own rotary table: no context reads past it
    # a tree drafts through torch (the C kernels draft chains): int8 rows on the CPU
    int8 = target.w["embed"].device.type == "cpu" if cfg.speculative_tree else None
    return EagleHead(
        path,
        target.w["embed"],
        target.lm_head,
        mc.vocab_size,
        mc.rms_eps,
        kv_shape,
        int8,
        positions,
    )


class SpecDecoder:
    """Runs `spec` steps. Owns nothing between steps: the draft state lives in the `spec` kind
    (its buffers, `draft_len` and `hidden_of`), the request states in the worker's
    `RunningRequests`."""

    def __init__(
        self,
        cfg: EngineConfig,
        target: LlamaModel,
        forward: Callable[[list[Feed]], tuple[torch.Tensor, list[int]]],
        requests: RunningRequests,
        sampler: Sampler,
        spec: Spec,
        draft: LlamaModel | None,
        head: EagleHead | None = None,
        kv: KvCaches | None = None,
    ):
        """`kv`: the target's caches, where a draft tree's accepted rows move (`tree.py`)."""
        self.cfg = cfg
        self.target = target
        self.forward = forward
        self.requests = requests
        self.sampler = sampler
        self.spec = spec
        self.draft: DraftModelProposer | None = None
        if draft is not None:
            self.draft = DraftModelProposer(draft, spec, requests, sampler, cfg.block_size)
        self.eagle = None if head is None else EagleProposer(head, spec, requests)
        self.on_cpu = target.w["embed"].device.type == "cpu"
        self.tree: TreeStep | None = None
        if cfg.speculative_tree and self.eagle is not None and kv is not None:
            self.tree = TreeStep(cfg, target, forward, requests, sampler, spec, self.eagle, kv)

    def forget(self, request_id: str) -> None:
        self.spec.forget(request_id)

    def _propose(self, seqs: list[SeqPlan]) -> tuple[list[list[int]], list]:
        cfg = self.cfg
        if self.draft is not None:
            return self.draft.propose(seqs, [seq.num_drafts for seq in seqs])
        if self.eagle is not None:
            with small_work(self.on_cpu):
                drafts = self.eagle.propose(seqs, [seq.num_drafts for seq in seqs])
            return drafts, [None] * len(seqs)
        drafts = [
            ngram_propose(
                self.requests[s.request_id].tokens, s.num_drafts, cfg.ngram_max, cfg.ngram_min
            )
            for s in seqs
        ]
        return drafts, [None] * len(seqs)

    def run(self, plan: StepPlan) -> tuple[list[SeqResult], torch.Tensor]:
        if self.tree is not None:
            return self.tree.run(plan)
        admitted = plan.admitted_ids
        for seq in plan.seqs:
            if seq.request_id in admitted:
                # admitted (again): the draft KV holds nothing of it, even where a prefix hit
                # reuses the target's pages, so the draft catches up from position 0
                self.forget(seq.request_id)
        spec_seqs = [
            s for s in plan.seqs if s.samples and s.num_drafts > 0 and len(s.token_ids) == 1
        ]
        drafts_of: dict[str, list[int]] = {}
        q_of: dict[str, object] = {}
        if spec_seqs:
            drafts, qs = self._propose(spec_seqs)
            for seq, d, q in zip(spec_seqs, drafts, qs, strict=True):
                drafts_of[seq.request_id], q_of[seq.request_id] = d, q
        feeds = [(s, s.token_ids + drafts_of.get(s.request_id, [])) for s in plan.seqs]
        hidden, last_rows = self.forward(feeds)
        rows_idx: list[int] = []
        sample_rows: list[Row] = []
        owners: list[tuple[SeqPlan, int, int]] = []  # (seq, rows it owns, its last row)
        for (seq, _), last in zip(feeds, last_rows, strict=True):
            if not seq.samples:
                continue
            req = self.requests[seq.request_id]
            seq_drafts = drafts_of.get(seq.request_id, [])
            n = len(seq_drafts) + 1
            rows_idx.extend(range(last - n + 1, last + 1))
            base = len(req.tokens)
            for j in range(n):
                history = req.tokens + seq_drafts[:j]
                sample_rows.append(req.row(base + j, history))
            owners.append((seq, n, last))
        h = hidden[rows_idx]
        if not owners:
            return [], h
        logits = self.target.logits(h, self.sampler.logits_out(len(rows_idx)))
        raw = self.sampler.keep_raw(logits) if any(r.params.logprobs for r in sample_rows) else None
        self.sampler.constrain(logits, sample_rows)  # each draft row masked after its drafts
        # greedy rows whose logits nothing adjusts: a one-hot target at each argmax (accept_greedy)
        if all(r.params.takes_argmax for r in sample_rows):
            probs, choices = None, logits.argmax(dim=-1).tolist()
        else:
            probs, choices = self.sampler.distribution(logits, sample_rows), []
        results = []
        offset = 0
        kept: list[Kept] = []
        for seq, n, last in owners:
            seq_drafts = drafts_of.get(seq.request_id, [])
            rows = sample_rows[offset : offset + n]
            q = q_of.get(seq.request_id)
            residual = self.spec.held["residual"]
            if probs is None:
                tokens, accepted = accept_greedy(choices[offset : offset + n], seq_drafts)
            else:
                p = probs[offset : offset + n]
                tokens, accepted = accept_drafts(p, rows, seq_drafts, q, residual)
            logprobs = []
            if raw is not None and rows[0].params.logprobs:
                own = raw[offset : offset + len(tokens)]
                logprobs = top_logprobs(own, tokens, rows[0].params.logprobs, in_place=True)
            proposed = len(seq_drafts)
            results.append(SeqResult(seq.request_id, tokens, logprobs, proposed, accepted))
            if self.draft is not None and seq.request_id in drafts_of:
                base = len(self.requests[seq.request_id].tokens)
                self.spec.draft_len[seq.request_id] = base + min(accepted, max(proposed - 1, 0))
            if self.eagle is not None:
                kept.append(self.eagle.kept(seq, last - n + 1, tokens))
            offset += n
        if self.eagle is not None:
            with small_work(self.on_cpu):
                self.eagle.keep(kept, hidden)
        return results, h


def accept_greedy(choices: list[int], drafts: list[int]) -> tuple[list[int], int]:
    """`accept_drafts` where every target row is one-hot at `choices` (greedy, no penalties):
    the drafts up to the first that is not the target's choice, then the choice there. Any
    draft distribution gives the same: p(d) / q(d) is 0 off the choice and >= 1 on it."""
    for j, d in enumerate(drafts):
        if d != choices[j]:
            return [*drafts[:j], choices[j]], j
    return [*drafts, choices[len(drafts)]], len(drafts)


def accept_drafts(
    p: torch.Tensor, rows: list[Row], drafts: list[int], q, residual: torch.Tensor
) -> tuple[list[int], int]:
    """Tokens appended (accepted drafts, then one more) and how many drafts were accepted.

    p: [len(drafts) + 1, V] target distributions; q: [>= len(drafts), V] draft distributions,
    or None for a deterministic proposer (q one-hot at the draft); residual: [2, V] float32
    workspace (the `spec` kind's) for a rejected draft's distribution and its running sum."""
    out: list[int] = []
    dist, scratch = residual[0:1], residual[1:2]
    for j, d in enumerate(drafts):
        pos, seed = rows[j].position, rows[j].seed
        q_d = 1.0 if q is None else float(q[j, d])
        p_d = float(p[j, d])
        if q_d > 0 and uniform(seed, pos, ACCEPT) < p_d / q_d:
            out.append(d)
            continue
        if q is None:
            dist[0].copy_(p[j])
            dist[0, d] = 0.0
        else:
            torch.sub(p[j], q[j], out=dist[0]).clamp_(min=0.0)
        if float(dist.sum()) <= 0.0:
            dist[0].copy_(p[j])
        u = torch.tensor([uniform(seed, pos, SAMPLE)])
        out.append(inverse_cdf(dist, u, scratch)[0])
        return out, j
    j = len(drafts)
    u = torch.tensor([uniform(rows[j].seed, rows[j].position, SAMPLE)])
    out.append(inverse_cdf(p[j : j + 1], u, scratch)[0])
    return out, len(drafts)
