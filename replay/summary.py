"""What a stream of engine records adds up to: requests, steps per kind, transitions, acceptance,
memory growth per kind, leak reports, prefix-cache hits.  Used by `inspect`, `plot` and the
what-if report.

Memory growth is counted per stretch: a run of consecutive steps of one kind.  A stretch's growth
is the live bytes after its last step minus those after its first, so the cost of entering a
kind is not mistaken for growth within it, and steady growth while one kind runs (the signature
of a leak) is.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs

from memstep.events.stretches import Stretch
from memstep.events.stretches import stretches as find_stretches
from memstep.events.types import (
    DraftLengthChanged,
    ExecutorLost,
    LeakSuspected,
    PhaseChanged,
    RecoveryDone,
    RequestAdded,
    RequestFinished,
    RequestPreempted,
    RequestResumed,
    SpecThresholdChanged,
    StateEntered,
    StateExited,
    StepFinished,
    StepPlanned,
    is_leak,
)


@attrs.frozen
class RequestTotals:
    num_added: int
    num_finished: int
    num_unfinished: int  # added, never finished (still running when the log ends)
    reasons: dict[str, int]  # finish reason -> count
    prompt_tokens: int  # of finished requests
    completion_tokens: int  # of finished requests
    cached_tokens: int  # prompt tokens of finished requests reused from the prefix cache

    @property
    def prefix_hit_rate(self) -> float | None:
        """The share of finished requests' prompt tokens that the prefix cache held."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


@attrs.frozen
class KindTotals:
    num_steps: int
    num_tokens: int  # tokens scheduled (fed), drafts included
    num_sampled: int  # tokens appended to requests
    num_proposed: int  # speculative drafts proposed
    num_accepted: int
    num_stretches: int
    growth: int  # live bytes gained within stretches of this kind, summed
    max_growth: int  # the largest single stretch's growth


@attrs.frozen
class Transition:
    step: int
    source: str
    target: str
    bytes_released: int  # by the exit hook of `source`
    bytes_claimed: int  # by the enter hook of `target`


@attrs.frozen
class KindLedger:
    """What one kind's enter hooks claimed and its exit hooks released, over the whole log: equal
    to the byte when every exit gave back what its entry took."""

    claimed: int
    released: int
    num_entries: int
    num_exits: int

    @property
    def is_balanced(self) -> bool:
        return self.claimed == self.released


@attrs.frozen
class HostRss:
    """A process's resident host bytes after the first step, at their peak, after the last."""

    first: int
    peak: int
    final: int


@attrs.frozen
class LogSummary:
    requests: RequestTotals
    kinds: dict[str, KindTotals]
    transitions: list[Transition]
    ledger: dict[str, KindLedger]  # kind -> its claims and releases, start-up kinds included
    stretches: list[Stretch]
    leaks: list[LeakSuspected]
    high_water: list[LeakSuspected]  # figures that rose once and stayed: information
    phases: list[list]  # [step, old, new]
    losses: list[ExecutorLost]  # executors lost (died, silent, or erring), in order
    recoveries: list[RecoveryDone]  # recoveries completed, in order
    num_steps: int
    num_proposed: int
    num_accepted: int
    peak_live_bytes: int
    final_live_bytes: int
    peak_reserved_bytes: int
    peak_arena_claimed_bytes: int
    peak_kv_pages_used: int
    num_prefix_hits: int  # admissions that reused cached pages (StepPlanned.cached)
    peak_kv_pages_cached: int  # pages held by no request that cache a prefix block
    final_kv_pages_cached: int
    host_rss: dict[str, HostRss]  # "executor", "core": where measured
    # the automatic speculation threshold's changes, in order: [step, threshold (None: none)]
    spec_thresholds: list[list]
    draft_lengths: dict[str, int]  # per-request K changes: "dropped", "raised"
    evictions: dict[str, int]  # requests sent back to recompute, by cause (RequestPreempted)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted / self.num_proposed if self.num_proposed else None

    def to_dict(self) -> dict[str, Any]:
        data = attrs.asdict(self)
        data["acceptance_rate"] = self.acceptance_rate
        data["requests"]["prefix_hit_rate"] = self.requests.prefix_hit_rate
        return data


def summarize(records: list[object]) -> LogSummary:
    """Add up a stream of records (a whole log, or what a replay emitted)."""
    steps = [r for r in records if isinstance(r, StepFinished)]
    planned = {r.step: r for r in records if isinstance(r, StepPlanned)}
    stretches = find_stretches(records)
    mems = [s.memory for s in steps]
    return LogSummary(
        requests=_requests(records),
        kinds=_kinds(steps, planned, stretches),
        transitions=_transitions(records),
        ledger=_ledger(records),
        stretches=stretches,
        leaks=[r for r in records if is_leak(r)],
        high_water=[r for r in records if isinstance(r, LeakSuspected) and not r.is_leak],
        phases=[[r.step, r.old, r.new] for r in records if isinstance(r, PhaseChanged)],
        losses=[r for r in records if isinstance(r, ExecutorLost)],
        recoveries=[r for r in records if isinstance(r, RecoveryDone)],
        num_steps=len(steps),
        num_proposed=sum(s.num_proposed for s in steps),
        num_accepted=sum(s.num_accepted for s in steps),
        peak_live_bytes=max((m.live_bytes for m in mems), default=0),
        final_live_bytes=mems[-1].live_bytes if mems else 0,
        peak_reserved_bytes=max((m.reserved_bytes for m in mems), default=0),
        peak_arena_claimed_bytes=max((m.arena_claimed_bytes for m in mems), default=0),
        peak_kv_pages_used=max((m.kv_pages_used for m in mems), default=0),
        num_prefix_hits=sum(len(p.cached) for p in planned.values()),
        peak_kv_pages_cached=max((m.kv_pages_cached for m in mems), default=0),
        final_kv_pages_cached=mems[-1].kv_pages_cached if mems else 0,
        host_rss=_host_rss(mems),
        spec_thresholds=[
            [r.step, r.threshold] for r in records if isinstance(r, SpecThresholdChanged)
        ],
        draft_lengths=_draft_lengths(records),
        evictions=dict(Counter(r.cause for r in records if isinstance(r, RequestPreempted))),
    )


def _draft_lengths(records: list[object]) -> dict[str, int]:
    changes = [r for r in records if isinstance(r, DraftLengthChanged)]
    return {
        "dropped": sum(r.new < r.old for r in changes),
        "raised": sum(r.new > r.old for r in changes),
    }


def tokens_by_request(records: list[object]) -> dict[str, list[int]]:
    """Every request's sampled tokens, in order, from StepFinished.sampled."""
    tokens: dict[str, list[int]] = {}
    for rec in records:
        if isinstance(rec, StepFinished):
            for request_id, new in rec.sampled:
                tokens.setdefault(request_id, []).extend(new)
    return tokens


def _requests(records: list[object]) -> RequestTotals:
    added = {r.request_id for r in records if isinstance(r, RequestAdded | RequestResumed)}
    finished = [r for r in records if isinstance(r, RequestFinished)]
    return RequestTotals(
        num_added=len(added),
        num_finished=len(finished),
        num_unfinished=len(added - {r.request_id for r in finished}),
        reasons=dict(Counter(r.reason for r in finished).most_common()),
        prompt_tokens=sum(r.prompt_tokens for r in finished),
        completion_tokens=sum(r.completion_tokens for r in finished),
        cached_tokens=sum(r.cached_tokens for r in finished),
    )


def _kinds(
    steps: list[StepFinished], planned: dict[int, StepPlanned], stretches: list[Stretch]
) -> dict[str, KindTotals]:
    totals: dict[str, KindTotals] = {}
    for kind in dict.fromkeys(s.kind for s in steps):
        mine = [s for s in steps if s.kind == kind]
        runs = [st for st in stretches if st.kind == kind]
        totals[kind] = KindTotals(
            num_steps=len(mine),
            num_tokens=sum(planned[s.step].num_tokens for s in mine if s.step in planned),
            num_sampled=sum(len(new) for s in mine for _, new in s.sampled),
            num_proposed=sum(s.num_proposed for s in mine),
            num_accepted=sum(s.num_accepted for s in mine),
            num_stretches=len(runs),
            growth=sum(st.growth for st in runs),
            max_growth=max(st.growth for st in runs),
        )
    return totals


def _transitions(records: list[object]) -> list[Transition]:
    """Each time a kind (warmup, capture, a serving kind) is entered: from which state, and the
    bytes moved.  A phase change comes before the exit and entry records it caused."""
    out: list[Transition] = []
    source = "boot"
    released = 0
    for rec in records:
        if isinstance(rec, PhaseChanged):
            source = rec.old
        elif isinstance(rec, StateExited):
            source, released = rec.kind, rec.bytes_released
        elif isinstance(rec, StateEntered):
            out.append(Transition(rec.step, source, rec.kind, released, rec.bytes_claimed))
            source, released = rec.kind, 0
    return out


def _ledger(records: list[object]) -> dict[str, KindLedger]:
    totals: dict[str, list[int]] = {}
    for rec in records:
        if isinstance(rec, StateEntered):
            t = totals.setdefault(rec.kind, [0, 0, 0, 0])
            t[0] += rec.bytes_claimed
            t[2] += 1
        elif isinstance(rec, StateExited):
            t = totals.setdefault(rec.kind, [0, 0, 0, 0])
            t[1] += rec.bytes_released
            t[3] += 1
    return {kind: KindLedger(*t) for kind, t in totals.items()}


def _host_rss(mems: list) -> dict[str, HostRss]:
    out = {}
    for process in ("executor", "core"):
        figures = [getattr(m, f"{process}_rss_bytes") for m in mems]
        if any(figures):
            out[process] = HostRss(figures[0], max(figures), figures[-1])
    return out
