"""The executor's memory of running requests: params arrive once, history stays consistent."""

from __future__ import annotations

import pytest

from memstep.core.sampling_params import SamplingParams
from memstep.events.plan import Admission, SeqPlan
from memstep.executors.runtime.running_requests import RunningRequests


def plan(start: int, tokens: list[int], table: list[int] | None = None, held: int = 0) -> SeqPlan:
    return SeqPlan(
        request_id="r",
        start_pos=start,
        token_ids=tokens,
        block_table=[0] if table is None else table,
        samples=True,
        num_drafts=0,
        prompt_len=3,
        num_pages_held=held,
    )


def admission(params: SamplingParams, prefix_ids: list[int] | None = None) -> Admission:
    return Admission(request_id="r", params=params, prefix_ids=prefix_ids or [])


def test_params_arrive_with_the_admission_and_are_kept():
    states = RunningRequests()
    first = states.update(plan(0, [5, 6, 7]), admission(SamplingParams(temperature=0.5, seed=3)))
    states.append("r", [8])
    later = states.update(plan(3, [8]))
    assert later is first and later.params.temperature == 0.5 and later.tokens == [5, 6, 7, 8]
    again = states.update(plan(0, [5, 6, 7, 8]), admission(SamplingParams(temperature=0.0)))
    assert again.params.temperature == 0.0 and again.tokens == [5, 6, 7, 8]  # recomputed


def test_a_plan_that_continues_an_unknown_request_is_refused():
    with pytest.raises(RuntimeError, match="does not know"):
        RunningRequests().update(plan(3, [8]))
    with pytest.raises(RuntimeError, match="does not know"):  # a first plan without admission
        RunningRequests().update(plan(0, [5, 6, 7]))
    states = RunningRequests()
    states.update(plan(0, [5, 6, 7]), admission(SamplingParams(temperature=0.0)))
    with pytest.raises(RuntimeError, match="plan starts at 9"):
        states.update(plan(9, [1]))


def test_a_prefix_hit_teaches_the_executor_the_cached_tokens():
    states = RunningRequests()
    params = SamplingParams(temperature=0.0, seed=4)
    first = states.update(plan(4, [9, 8], [0, 1]), admission(params, [5, 6, 7, 1]))
    assert first.tokens == [5, 6, 7, 1, 9, 8] and first.params.seed == 4
    with pytest.raises(RuntimeError, match="carries 3 cached prefix tokens"):
        states.update(plan(4, [9, 8], [0, 1]), admission(params, [5, 6, 7]))


def test_a_plan_s_table_tail_is_made_whole_from_the_pages_held():
    states = RunningRequests()
    params = SamplingParams(temperature=0.0)
    states.update(plan(0, [5, 6, 7], [4, 9]), admission(params))
    states.append("r", [8])
    same = plan(3, [8], [], held=2)  # no new page
    assert states.update(same).table == [4, 9] == same.block_table
    states.append("r", [1])
    grown = plan(4, [1], [12], held=2)  # one new page
    assert states.update(grown).table == [4, 9, 12] == grown.block_table
    with pytest.raises(RuntimeError, match="continues at entry 5 but the executor holds 3"):
        states.update(plan(5, [2], [13], held=5))
    readmitted = plan(0, [5, 6, 7, 8, 1], [30, 31])  # whole again
    assert states.update(readmitted, admission(params)).table == [30, 31]
