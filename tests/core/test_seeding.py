"""Seeds: the engine-wide seed, the seeds drawn for requests that have none, and their checks.

The tiny random model, in-process; the real model's texts are in tests/replay/.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from memstep.core.config import ConfigError, EngineConfig
from memstep.core.sampling_params import InvalidRequest, SamplingParams
from memstep.core.seeding import RequestSeeds, engine_seed
from memstep.events.types import EngineStarted, RequestAdded
from memstep.executors.process.inprocess import local_engine
from memstep.executors.runtime.sampler import Row, Sampler

TINY = EngineConfig(model="random:tiny", max_num_seqs=4, num_threads=1)


def tiny_engine(seed: int | None):
    records: list[object] = []
    return local_engine(TINY.replace(seed=seed), sinks=[records.append]), records


def added_seeds(records: list[object]) -> list[int]:
    return [r.params.seed for r in records if isinstance(r, RequestAdded)]


def test_unseeded_requests_draw_from_the_engine_seed_in_arrival_order():
    first, first_records = tiny_engine(seed=11)
    second, second_records = tiny_engine(seed=11)
    other, other_records = tiny_engine(seed=12)
    for engine in (first, second, other):
        for _ in range(3):
            engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=1))
        engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=1, seed=42))
    seeds = added_seeds(first_records)
    assert len(set(seeds[:3])) == 3 and seeds[3] == 42
    assert added_seeds(second_records) == seeds
    assert added_seeds(other_records)[:3] != seeds[:3] and added_seeds(other_records)[3] == 42
    drawn = RequestSeeds(11)
    assert seeds[:3] == [drawn.draw() for _ in range(3)]


def test_a_refused_request_draws_no_seed():
    engine, records = tiny_engine(seed=11)
    with pytest.raises(InvalidRequest):
        engine.add_request([], SamplingParams(temperature=0.0, max_tokens=1))
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=1))
    assert added_seeds(records) == [RequestSeeds(11).draw()]


def test_without_a_seed_the_engine_seed_comes_from_entropy_and_is_recorded():
    (a, a_records), (b, b_records) = tiny_engine(seed=None), tiny_engine(seed=None)
    started = [r for r in (a_records[0], b_records[0]) if isinstance(r, EngineStarted)]
    seeds = [s.config["seed"] for s in started]
    assert len(started) == 2 and all(isinstance(s, int) for s in seeds)
    assert seeds == [a.cfg.seed, b.cfg.seed] and seeds[0] != seeds[1]
    assert engine_seed(TINY.replace(seed=7)) == 7


def test_request_seeds_repeat_for_one_engine_seed():
    one, again, other = RequestSeeds(3), RequestSeeds(3), RequestSeeds(4)
    drawn = [one.draw() for _ in range(5)]
    assert drawn == [again.draw() for _ in range(5)]
    assert drawn != [other.draw() for _ in range(5)]
    assert all(0 <= s < 2**63 for s in drawn)


@pytest.mark.parametrize(
    ("value", "message"),
    [("7", "wrong type"), (True, "wrong type"), (-1, r"seed must be in"), (2**63, "seed must")],
)
def test_bad_request_seeds_are_refused(value, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams.from_dict({"seed": value})


def test_request_seed_may_be_absent_or_null():
    assert SamplingParams.from_dict({"seed": None}).seed is None
    assert SamplingParams.from_dict({}).seed is None
    assert SamplingParams.from_dict({"seed": 9}).seed == 9


def test_bad_engine_seeds_and_thread_counts_are_refused():
    with pytest.raises(ConfigError, match="seed must be in"):
        EngineConfig(seed=-1)
    with pytest.raises(ConfigError, match="num_threads"):
        EngineConfig(num_threads=0)


def test_a_config_from_an_older_log_keeps_its_random_weights():
    """Before the split, `seed` seeded random: weights; such a log must load the same weights."""
    old = {k: v for k, v in TINY.to_dict().items() if k != "random_weights_seed"}
    assert EngineConfig.from_dict({**old, "seed": 5}).random_weights_seed == 5
    assert EngineConfig.from_dict({**old, "seed": None}).random_weights_seed == 0
    assert EngineConfig.from_dict(TINY.replace(seed=5).to_dict()).random_weights_seed == 0


def test_random_weights_keep_their_own_seed_in_the_model_identity():
    engine = local_engine(TINY.replace(random_weights_seed=3, seed=99))
    assert engine.source.identity == "random:tiny:seed=3"


def test_the_sampler_refuses_a_row_without_a_seed():
    sampler = Sampler(max_rows=1, vocab_size=4, device=torch.device("cpu"))
    probs = torch.full((1, 4), 0.25)
    seeded = Row(SamplingParams(temperature=1.0, seed=1), 0, [], 0)
    assert sampler.sample(probs, [seeded]) == sampler.sample(probs, [seeded])
    with pytest.raises(ValueError, match="no seed"):
        sampler.sample(probs, [attrs.evolve(seeded, params=SamplingParams(temperature=1.0))])
