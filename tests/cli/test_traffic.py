"""The synthetic memory-stress traffic (used on the GPU by test_gpu.py and bench_gpu.py)."""

from __future__ import annotations

import random

from memstep.cli.traffic import random_params, rising_waves
from memstep.core.config import EngineConfig
from memstep.events.types import RequestAdded, RequestFinished, StepPlanned
from memstep.executors.process.inprocess import local_engine


def test_random_params_cover_every_sampling_feature():
    rng = random.Random(0)
    params = [random_params(rng) for _ in range(200)]
    assert any(p.is_greedy for p in params) and any(not p.is_greedy for p in params)
    assert {p.top_k for p in params} == {0, 20, 200}
    assert any(p.logprobs for p in params) and any(p.has_penalties for p in params)
    assert len({p.seed for p in params}) == 200


def test_rising_waves_double_up_to_the_cap_with_mixed_steps():
    records: list = []
    cfg = EngineConfig(model="random:tiny", max_num_seqs=4, num_threads=1)
    engine = local_engine(cfg, sinks=[records.append])
    try:
        steps = rising_waves(engine, num_requests=15, max_concurrency=4, seed=1)
    finally:
        engine.shutdown()
    added = [r for r in records if isinstance(r, RequestAdded)]
    finished = [r for r in records if isinstance(r, RequestFinished)]
    planned = [r for r in records if isinstance(r, StepPlanned)]
    assert len(added) == len(finished) == 15 and steps == len(planned)
    # waves of 1, 2, 4, 4, 4: the largest batch is the cap, and a wave's late half makes
    # steps that prefill beside decodes
    assert max(len(p.batch) for p in planned) == 4
    assert any(len({n > 1 for _, n in p.batch}) == 2 for p in planned)
