"""Per-request adaptive K: how many drafts a request is given each `spec` step.

A request starts at `num_speculative_tokens`. Each spec step of it is evidence of how often its
drafts are accepted, one after the other: the accepted drafts are hits, and a rejected draft
(the first one that differs) a miss. Its acceptance `alpha` is hits over trials, the older
steps weighed down by `DECAY` a step (from a prior of one half). Draft j of a step is kept only
when all before it are, with probability alpha ** j: the request's K is the largest whose last
draft is accepted at least `MIN_LAST_DRAFT` of the time (within [1, num_speculative_tokens],
moving one a step). A draft position costs a verify row and a draft step, a small fraction of
a step where speculation pays at all (else the automatic threshold turns it off, from measured
costs: core/spec_threshold.py); a last draft that pays back less than that stops being drafted.

The rule it replaces dropped K after two steps in a row with nothing accepted: an EAGLE head
that accepts a third of its drafts misses a whole step about half the time, so K fell and
rose without end, and one stream spent much of its steps at K = 1.

Acceptance depends only on tokens, so the changes are derived facts: the engine records each
(`DraftLengthChanged`) and a replay reproduces them.
"""

from __future__ import annotations

import math

from memstep.core.request import Request

DECAY = 0.95  # the weight of a request's earlier evidence at each of its spec steps
MIN_LAST_DRAFT = 0.06  # a K's last draft must be accepted at least this often
PRIOR_TRIALS = 2.0  # a fresh request's evidence: 1 hit in 2 trials


def best_k(alpha: float, k_max: int) -> int:
    """The largest K in [1, k_max] whose last draft is accepted (alpha ** K) at least
    MIN_LAST_DRAFT of the time."""
    if alpha >= 1.0:
        return k_max
    if alpha <= 0.0:
        return 1
    return max(1, min(k_max, int(math.log(MIN_LAST_DRAFT) / math.log(alpha))))


def adapt(req: Request, num_proposed: int, num_accepted: int, k_max: int) -> int | None:
    """Update `req`'s acceptance and K after a spec step of it; its new K if that changed."""
    if num_proposed == 0:
        return None  # nothing proposed (no n-gram found, a fresh EAGLE state): no evidence
    if req.draft_trials == 0.0:
        req.draft_hits, req.draft_trials = PRIOR_TRIALS / 2, PRIOR_TRIALS
    missed = 1 if num_accepted < num_proposed else 0
    req.draft_hits = DECAY * req.draft_hits + num_accepted
    req.draft_trials = DECAY * req.draft_trials + num_accepted + missed
    old = req.draft_length or k_max
    wanted = best_k(req.draft_hits / req.draft_trials, k_max)
    new = min(max(wanted, old - 1), old + 1)
    req.draft_length = new
    return new if new != old else None
