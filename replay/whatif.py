"""What changed when a log was replayed under a different config (`replay --set ...`).

Not a field-by-field verdict but the figures a person asks about: steps per kind, transitions,
tokens, acceptance, memory growth per kind, leak reports.
"""

from __future__ import annotations

from typing import Any

import attrs

from memstep.replay.summary import LogSummary, summarize, tokens_by_request
from memstep.replay.text_table import fmt_bytes


@attrs.frozen
class Change:
    what: str
    recorded: int
    replayed: int
    is_bytes: bool = False

    @property
    def changed(self) -> bool:
        return self.recorded != self.replayed

    def row(self) -> list[Any]:
        rec, rep, delta = self.recorded, self.replayed, self.replayed - self.recorded
        if self.is_bytes:
            change = fmt_bytes(delta, signed=True) if delta else ""
            return [self.what, fmt_bytes(rec), fmt_bytes(rep), change]
        return [self.what, rec, rep, f"{delta:+d}" if delta else ""]


@attrs.frozen
class WhatIf:
    changes: list[Change]  # every figure of interest, changed or not
    leaks_recorded: list[str]  # one line per leak report
    leaks_replayed: list[str]

    @property
    def num_changed(self) -> int:
        return sum(c.changed for c in self.changes)


def what_if(recorded: list[object], replayed: list[object]) -> WhatIf:
    """The figures of interest of the recorded and the replayed records, side by side."""
    a, b = summarize(recorded), summarize(replayed)
    changes = [
        Change("steps", a.num_steps, b.num_steps),
        *_per_kind(a, b),
        Change("transitions", len(a.transitions), len(b.transitions)),
        Change("requests finished", a.requests.num_finished, b.requests.num_finished),
        *_reasons(a, b),
        Change("tokens generated", a.requests.completion_tokens, b.requests.completion_tokens),
        _tokens_changed(recorded, replayed),
        Change("drafts proposed", a.num_proposed, b.num_proposed),
        Change("drafts accepted", a.num_accepted, b.num_accepted),
        Change("peak live bytes", a.peak_live_bytes, b.peak_live_bytes, is_bytes=True),
        Change("final live bytes", a.final_live_bytes, b.final_live_bytes, is_bytes=True),
        Change("peak KV pages", a.peak_kv_pages_used, b.peak_kv_pages_used),
        Change("leak reports", len(a.leaks), len(b.leaks)),
    ]
    return WhatIf(changes, _leaks(a), _leaks(b))


def _per_kind(a: LogSummary, b: LogSummary) -> list[Change]:
    out = []
    for kind in dict.fromkeys([*a.kinds, *b.kinds]):
        ka, kb = a.kinds.get(kind), b.kinds.get(kind)
        out.append(Change(f"steps {kind}", ka.num_steps if ka else 0, kb.num_steps if kb else 0))
        growth_a, growth_b = ka.growth if ka else 0, kb.growth if kb else 0
        out.append(Change(f"memory growth {kind}", growth_a, growth_b, is_bytes=True))
    return out


def _reasons(a: LogSummary, b: LogSummary) -> list[Change]:
    reasons = dict.fromkeys([*a.requests.reasons, *b.requests.reasons])
    return [
        Change(f"finished: {r}", a.requests.reasons.get(r, 0), b.requests.reasons.get(r, 0))
        for r in reasons
    ]


def _tokens_changed(recorded: list[object], replayed: list[object]) -> Change:
    ta, tb = tokens_by_request(recorded), tokens_by_request(replayed)
    differ = sum(1 for rid in ta.keys() | tb.keys() if ta.get(rid) != tb.get(rid))
    return Change("requests with other tokens", 0, differ)


def _leaks(s: LogSummary) -> list[str]:
    return [f"step {x.step} {x.kind} {x.what} {fmt_bytes(x.nbytes)}" for x in s.leaks]
