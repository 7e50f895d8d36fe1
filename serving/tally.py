"""Running totals the server reports in StatsReply, counted from the engine's own records.

`Tally` is an engine sink (like the recorder): it learns what happened from the records the
engine emits, so the totals agree with the event log and the engine keeps no second copy.
"""

from __future__ import annotations

import collections
import operator
import os
from pathlib import Path

from memstep.events.types import RequestAdded, StateEntered, StepFinished, is_leak

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_TOKENS = operator.itemgetter(1)  # of a StepFinished.sampled row: [request id, tokens]


class Tally:
    """Totals since the server started: tokens, steps by kind, kind transitions, leak reports."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_leak_reports = 0
        self.steps: collections.Counter[str] = collections.Counter()
        self.transitions: collections.Counter[str] = collections.Counter()
        self.kind = ""

    def __call__(self, rec: object) -> None:
        if isinstance(rec, RequestAdded):
            self.prompt_tokens += len(rec.prompt_token_ids)
        elif isinstance(rec, StepFinished):
            self.steps[rec.kind] += 1
            self.generation_tokens += sum(map(len, map(_TOKENS, rec.sampled)))
        elif isinstance(rec, StateEntered):
            self.transitions[f"{self.kind or 'none'}->{rec.kind}"] += 1
            self.kind = rec.kind
        elif is_leak(rec):  # a high-water mark is information, not a leak
            self.num_leak_reports += 1


def host_rss_bytes(pids: dict[str, int]) -> dict[str, int]:
    """Resident bytes of each named live process on this host (from /proc); absent ones left out."""
    out = {}
    for name, pid in pids.items():
        try:
            pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out[name] = pages * PAGE_BYTES
    return out
