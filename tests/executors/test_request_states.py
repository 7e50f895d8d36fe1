"""The executor's memory of running requests: params arrive once, history stays consistent."""

from __future__ import annotations

import pytest

from memstep.core.sampling_params import SamplingParams
from memstep.events.plan import SeqPlan
from memstep.executors.runtime.request_states import RequestStates


def plan(start: int, tokens: list[int], params: dict) -> SeqPlan:
    return SeqPlan("r", start, tokens, [0], True, 0, 3, params)


def test_params_arrive_with_the_first_chunk_and_are_kept():
    states = RequestStates()
    first = states.update(plan(0, [5, 6, 7], SamplingParams(temperature=0.5, seed=3).to_dict()))
    states.append("r", [8])
    later = states.update(plan(3, [8], {}))
    assert later is first and later.params.temperature == 0.5 and later.tokens == [5, 6, 7, 8]
    again = states.update(
        plan(0, [5, 6, 7, 8], SamplingParams(temperature=0.0).to_dict())
    )  # recomputed
    assert again.params.temperature == 0.0 and again.tokens == [5, 6, 7, 8]


def test_a_plan_that_continues_an_unknown_request_is_refused():
    with pytest.raises(RuntimeError, match="does not know"):
        RequestStates().update(plan(3, [8], {}))
    states = RequestStates()
    states.update(plan(0, [5, 6, 7], SamplingParams(temperature=0.0).to_dict()))
    with pytest.raises(RuntimeError, match="plan starts at 9"):
        states.update(plan(9, [1], {}))


def test_a_prefix_hit_teaches_the_executor_the_cached_tokens():
    states = RequestStates()
    params = SamplingParams(temperature=0.0, seed=4).to_dict()
    first = states.update(SeqPlan("r", 4, [9, 8], [0, 1], True, 0, 6, params, [5, 6, 7, 1]))
    assert first.tokens == [5, 6, 7, 1, 9, 8] and first.params.seed == 4
    with pytest.raises(RuntimeError, match="carries 3 cached prefix tokens"):
        states.update(SeqPlan("r", 4, [9, 8], [0, 1], True, 0, 6, params, [5, 6, 7]))


def test_a_plan_s_table_tail_is_made_whole_from_the_pages_held():
    states = RequestStates()
    params = SamplingParams(temperature=0.0).to_dict()
    states.update(SeqPlan("r", 0, [5, 6, 7], [4, 9], True, 0, 3, params))
    states.append("r", [8])
    same = SeqPlan("r", 3, [8], [], True, 0, 3, {}, [], 2)  # no new page
    assert states.update(same).table == [4, 9] == same.block_table
    states.append("r", [1])
    grown = SeqPlan("r", 4, [1], [12], True, 0, 3, {}, [], 2)  # one new page
    assert states.update(grown).table == [4, 9, 12] == grown.block_table
    with pytest.raises(RuntimeError, match="continues at entry 5 but the executor holds 3"):
        states.update(SeqPlan("r", 5, [2], [13], True, 0, 3, {}, [], 5))
    readmitted = SeqPlan("r", 0, [5, 6, 7, 8, 1], [30, 31], True, 0, 3, params)  # whole again
    assert states.update(readmitted).table == [30, 31]
