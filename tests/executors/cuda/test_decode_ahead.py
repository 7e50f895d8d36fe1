"""`Ahead.rows`: a plan's feed takes its row from the decode step replayed ahead only when the
replay ran exactly that feed: same sequence, position, KV slot and token.

The GPU test (`test_gpu.py::test_decode_ahead_changes_no_token`) runs the replay itself."""

from __future__ import annotations

import torch

from memstep.events.plan import SeqPlan
from memstep.executors.cuda.decode_ahead import Ahead
from memstep.executors.runtime.sampler import HostCopy

BLOCK = 4


def feed(rid: str, start: int, token: int, table: list[int]) -> tuple[SeqPlan, list[int]]:
    return SeqPlan(rid, start, [token], table, True, 0, 3), [token]


def chunk(rid: str, start: int, tokens: list[int], table: list[int]) -> tuple[SeqPlan, list[int]]:
    return SeqPlan(rid, start, tokens, table, True, 0, start + len(tokens)), tokens


def ahead(tokens: list[int]) -> Ahead:
    # a: position 5 in page 7 (slot 29); b: position 8 in page 2 (slot 8)
    return Ahead(["a", "b"], [5, 8], [29, 8], HostCopy(torch.tensor(tokens)))


def test_the_step_replayed_takes_every_row():
    feeds = [feed("a", 5, 11, [3, 7]), feed("b", 8, 12, [0, 1, 2, 9])]
    assert ahead([11, 12]).rows(feeds, BLOCK) == [0, 1]


def test_a_mixed_plan_takes_the_rows_it_shares_in_its_own_order():
    # b, then a new prompt's chunk, then a; a request that finished (none here) just drops out
    feeds = [feed("b", 8, 12, [0, 1, 2]), chunk("c", 0, [4, 5, 6], [5]), feed("a", 5, 11, [3, 7])]
    assert ahead([11, 12]).rows(feeds, BLOCK) == [1, None, 0]
    assert ahead([11, 12]).rows(feeds[1:], BLOCK) == [None, 0]


def test_any_difference_is_not_the_replays_row():
    good = feed("b", 8, 12, [0, 1, 2])
    variants = {
        "unknown request": feed("c", 5, 11, [3, 7]),
        "position": feed("a", 6, 11, [3, 7]),
        "fed token": feed("a", 5, 10, [3, 7]),
        "page": feed("a", 5, 11, [3, 8]),
        "page missing": feed("a", 5, 11, [3]),
        "a chunk at the position": chunk("a", 5, [11, 13], [3, 7]),
    }
    for name, bad in variants.items():
        assert ahead([11, 12]).rows([bad, good], BLOCK) == [None, 1], name


def test_a_token_settled_on_the_host_after_the_replay_is_not_its_row():
    # the device fed -1 - 11 (a zero-probability draw, settled to 11 on the host later)
    feeds = [feed("a", 5, 11, [3, 7]), feed("b", 8, 12, [0, 1, 2])]
    assert ahead([-12, 12]).rows(feeds, BLOCK) == [None, 1]
