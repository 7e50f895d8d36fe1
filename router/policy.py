"""Where a request goes: the routing policies, pure functions of what the router recorded.

`prefix`: the live replica that was sent the longest prefix of the request (at least one block),
unless its load exceeds the least loaded one's by more than `balance_tokens`; else the least
loaded.  `load`: the least loaded live replica (ties: each in turn).  `round-robin`: the
next live replica in turn.  A replay (`router/replay.py`) calls the same `choose` with the
recorded inputs, so every decision is checked.
"""

from __future__ import annotations

import attrs

from memstep.router.prefix import PrefixIndex

POLICIES = ("prefix", "load", "round-robin")
BALANCE_TOKENS = 8192  # prefix routing gives way to load past this much extra load


class NoReplica(RuntimeError):
    """No replica serves."""


@attrs.frozen
class Choice:
    replica: int
    reason: str  # the policy that decided: "prefix" | "load" | "round-robin"
    matched_blocks: int


class Policy:
    """A policy and the state it keeps (the prefix index, the round-robin turn)."""

    def __init__(self, name: str, num_replicas: int, balance_tokens: int = BALANCE_TOKENS):
        if name not in POLICIES:
            raise ValueError(f"unknown routing policy {name!r}; use one of {', '.join(POLICIES)}")
        self.name = name
        self.balance_tokens = balance_tokens
        self.index = PrefixIndex(num_replicas)
        self.turn = 0

    def choose(self, hashes: list[int], loads: list[int], live: list[bool]) -> Choice:
        """Pick a replica for a request with these prefix `hashes`, and remember it was sent."""
        candidates = [i for i, ok in enumerate(live) if ok]
        if not candidates:
            raise NoReplica("no replica serves")
        choice = self._pick(candidates, hashes, loads)
        self.index.add(choice.replica, hashes)
        return choice

    def _pick(self, candidates: list[int], hashes: list[int], loads: list[int]) -> Choice:
        if self.name == "round-robin":
            replica = candidates[self.turn % len(candidates)]
            self.turn += 1
            return Choice(replica, "round-robin", self.index.matched(replica, hashes))
        least = min(candidates, key=lambda i: (loads[i], (i - self.turn) % len(loads)))
        self.turn += 1  # ties among the least loaded go round in turn
        if self.name == "prefix":
            best = max(candidates, key=lambda i: (self.index.matched(i, hashes), -loads[i], -i))
            matched = self.index.matched(best, hashes)
            if matched > 0 and loads[best] - loads[least] <= self.balance_tokens:
                return Choice(best, "prefix", matched)
        return Choice(least, "load", self.index.matched(least, hashes))

    def lose(self, replica: int) -> None:
        self.index.forget(replica)
