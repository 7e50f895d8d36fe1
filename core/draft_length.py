"""Per-request adaptive K: how many drafts a request is given each `spec` step.

A request starts at `num_speculative_tokens`. When none of its drafts is accepted in
`MISSES_TO_DROP` spec steps in a row, its K drops by one (never below 1, so that its drafts keep
being tried and can earn K back); when every draft of a step is accepted, its K rises by one (up
to `num_speculative_tokens`). Drafts that are rejected cost a verify row and a draft position
each; a request whose text the proposer cannot follow stops paying for them.

Acceptance depends only on tokens, so the changes are derived facts: the engine records each
(`DraftLengthChanged`) and a replay reproduces them.
"""

from __future__ import annotations

from memstep.core.request import Request

MISSES_TO_DROP = 2


def adapt(req: Request, num_proposed: int, num_accepted: int, k_max: int) -> int | None:
    """Update `req`'s K after a spec step of it; its new K if that changed, else None."""
    if num_proposed == 0:
        return None  # nothing proposed (no n-gram found, a fresh EAGLE state): no evidence
    old = new = req.draft_length or k_max
    if num_accepted == num_proposed:
        req.num_missed_steps = 0
        new = min(old + 1, k_max)
    elif num_accepted == 0:
        req.num_missed_steps += 1
        if req.num_missed_steps >= MISSES_TO_DROP:
            req.num_missed_steps = 0
            new = max(old - 1, 1)
    else:
        req.num_missed_steps = 0
    req.draft_length = new
    return new if new != old else None
