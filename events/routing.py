"""The records of a router's event log (`router/`): each routing decision and each migration.

A router's log has the header entry `"kind": "router"` and these records, in the one codec
(`events/codec.py`).  Each decision carries its inputs (the request's prefix block hashes, the
load and liveness of every replica as the router saw them) beside what was decided, so a replay
(`router/replay.py`) feeds the inputs through the same policy and checks every decision.
"""

from __future__ import annotations

from memstep.events.types import record

ROUTER_LOG_KIND = "router"  # the header's "kind" in a router's log


@record
class RequestRouted:
    """A new request sent to a replica."""

    seq: int  # the router's count of decisions so far
    request_id: str  # the client's id
    backend_id: str  # the id the router gave it at the replica
    seed: int  # the request's sampling seed (drawn by the router when the client gave none)
    prefix_hashes: list[int]  # input: the chained hashes of its prompt's blocks
    loads: list[int]  # input: each replica's load (prompt and output tokens in flight)
    live: list[bool]  # input: which replicas served
    replica: int  # derived: where it went
    reason: str  # derived: "prefix" | "load" | "round-robin"
    matched_blocks: int  # derived: blocks of its prefix the chosen replica was sent before
    arrival_time: float


@record
class ReplicaLost:
    """A replica stopped serving (its connection closed, or it stayed silent too long)."""

    seq: int
    replica: int
    endpoint: str
    reason: str
    num_unfinished: int  # its requests in flight, each migrated next


@record
class ReplicaReturned:
    """A lost replica answered `ok` again (it was paused, or cut off a while): it serves again."""

    seq: int
    replica: int
    endpoint: str


@record
class RequestMigrated:
    """A request of a lost replica resent to a live one with the tokens its client has."""

    seq: int
    request_id: str
    backend_id: str  # its new id at the new replica
    from_replica: int
    loads: list[int]  # input, as in RequestRouted
    live: list[bool]  # input
    replica: int  # derived: where it went
    reason: str  # derived
    matched_blocks: int  # derived
    tokens_carried: int  # output tokens its client had, sent with it


@record
class RouteEnded:
    """A request's end at the router: observed, not replayed."""

    seq: int
    request_id: str
    replica: int  # the replica that finished it
    finish_reason: str  # the replica's, or "route_lost" when no replica was left
    num_tokens: int
    num_migrations: int
    migration_pause_s: float  # summed: the last token before a loss to the next one after it
