"""`Ahead.matches`: a decode step replayed ahead is used only for exactly the step it ran.

The GPU test (`test_gpu.py::test_decode_ahead_changes_no_token`) runs the replay itself."""

from __future__ import annotations

import torch

from memstep.events.plan import SeqPlan
from memstep.executors.decode_ahead import Ahead
from memstep.executors.sampler import HostCopy

BLOCK = 4


def feed(rid: str, start: int, token: int, table: list[int]) -> tuple[SeqPlan, list[int]]:
    return SeqPlan(rid, start, [token], table, True, 0, 3, {}), [token]


def ahead(tokens: list[int]) -> Ahead:
    # a: position 5 in page 7 (slot 29); b: position 8 in page 2 (slot 8)
    return Ahead(["a", "b"], [5, 8], [29, 8], HostCopy(torch.tensor(tokens)))


def test_the_step_replayed_matches():
    feeds = [feed("a", 5, 11, [3, 7]), feed("b", 8, 12, [0, 1, 2, 9])]
    assert ahead([11, 12]).matches(feeds, BLOCK)


def test_any_difference_is_a_mismatch():
    base = [feed("a", 5, 11, [3, 7]), feed("b", 8, 12, [0, 1, 2])]
    assert ahead([11, 12]).matches(base, BLOCK)
    variants = {
        "a request left": base[:1],
        "a request joined": [*base, feed("c", 0, 1, [4])],
        "order": base[::-1],
        "position": [feed("a", 6, 11, [3, 7]), base[1]],
        "fed token": [feed("a", 5, 10, [3, 7]), base[1]],
        "page": [feed("a", 5, 11, [3, 8]), base[1]],
        "page missing": [feed("a", 5, 11, [3]), base[1]],
    }
    for name, feeds in variants.items():
        assert not ahead([11, 12]).matches(feeds, BLOCK), name


def test_a_token_settled_on_the_host_after_the_replay_is_a_mismatch():
    # the device fed -1 - 11 (a zero-probability draw, settled to 11 on the host later)
    feeds = [feed("a", 5, 11, [3, 7]), feed("b", 8, 12, [0, 1, 2])]
    assert not ahead([-12, 12]).matches(feeds, BLOCK)
