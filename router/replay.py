"""A router's log read back: its decisions replayed through the policy, and a summary of them.

Each RequestRouted and RequestMigrated record holds the inputs its decision was made from (the
prefix hashes, every replica's load and liveness); the replay feeds them, in order, through a
fresh `Policy` (whose prefix index and round-robin turn are built by the same decisions) and
checks that each decision is the one recorded.  The first that differs is the divergence.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import attrs

from memstep.events import routing  # noqa: F401 - registers the router's records with the codec
from memstep.events.log import LogReader, read_log
from memstep.events.routing import (
    ROUTER_LOG_KIND,
    ReplicaLost,
    ReplicaReturned,
    RequestMigrated,
    RequestRouted,
    RouteEnded,
)
from memstep.router.policy import Choice, NoReplica, Policy

COMPARED = ("replica", "reason", "matched_blocks")


def is_router_log(path: str | Path) -> bool:
    """Whether the log at `path` is a router's (its header's kind)."""
    with LogReader(path) as reader:
        return reader.header.get("kind") == ROUTER_LOG_KIND


@attrs.frozen
class RouterLog:
    header: dict[str, Any]
    records: list[object]
    num_problems: int

    @property
    def replicas(self) -> list[str]:
        return list(self.header["router"]["replicas"])

    @property
    def policy(self) -> str:
        return str(self.header["router"]["policy"])


def load_router_log(path: str | Path) -> RouterLog:
    header, records, problems = read_log(path)
    return RouterLog(header, records, len(problems))


@attrs.frozen
class Divergence:
    seq: int
    request_id: str
    field: str
    recorded: object
    replayed: object

    def __str__(self) -> str:
        return (
            f"decision {self.seq} ({self.request_id}): {self.field} recorded "
            f"{self.recorded!r}, replayed {self.replayed!r}"
        )


def replay_router(log: RouterLog) -> tuple[int, Divergence | None]:
    """(decisions checked, the first divergence or None)."""
    policy = Policy(log.policy, len(log.replicas))
    hashes: dict[tuple[str, int], list[int]] = {}
    checked = 0
    for rec in log.records:
        if isinstance(rec, ReplicaLost):
            policy.lose(rec.replica)
            continue
        if isinstance(rec, RequestRouted):
            prefix = rec.prefix_hashes
        elif isinstance(rec, RequestMigrated):
            prefix = hashes.pop((rec.request_id, rec.from_replica), [])
        else:
            continue
        hashes[(rec.request_id, rec.replica)] = prefix
        checked += 1
        diverged = _check(rec, _choose(policy, prefix, rec.loads, rec.live))
        if diverged is not None:
            return checked, diverged
    return checked, None


def _choose(policy: Policy, prefix: list[int], loads: list[int], live: list[bool]) -> Choice:
    try:
        return policy.choose(prefix, loads, live)
    except NoReplica:
        return Choice(-1, "none", 0)


def _check(rec: RequestRouted | RequestMigrated, choice: Choice) -> Divergence | None:
    for name in COMPARED:
        recorded, replayed = getattr(rec, name), getattr(choice, name)
        if recorded != replayed:
            return Divergence(rec.seq, rec.request_id, name, recorded, replayed)
    return None


def summarize(log: RouterLog) -> dict[str, Any]:
    """Routings by replica and reason, losses and returns, migrations, how the requests ended."""
    routed = collections.Counter(
        f"{r.replica}:{r.reason}" for r in log.records if isinstance(r, RequestRouted)
    )
    ended = [r for r in log.records if isinstance(r, RouteEnded)]
    moved = [r for r in ended if r.num_migrations]
    return {
        "policy": log.policy,
        "replicas": log.replicas,
        "routed": dict(sorted(routed.items())),
        "lost": [attrs.asdict(r) for r in log.records if isinstance(r, ReplicaLost)],
        "returned": [attrs.asdict(r) for r in log.records if isinstance(r, ReplicaReturned)],
        "migrations": [
            {k: v for k, v in attrs.asdict(r).items() if k not in ("loads", "live")}
            for r in log.records
            if isinstance(r, RequestMigrated)
        ],
        "ended": dict(collections.Counter(r.finish_reason for r in ended)),
        "migrated_pause_s": [r.migration_pause_s for r in moved],
    }
