"""The engine's own randomness: the engine-wide seed, and the seeds it draws for requests.

A request that comes without a seed gets one drawn from a generator seeded by the engine-wide
seed (as in vLLM), and the drawn seed is recorded with the request (RequestAdded's params), so a
replay reads it back and never draws.  Without a configured seed the engine-wide seed comes from
OS entropy at start and is recorded in the log header's config: two runs differ, each replays.
"""

from __future__ import annotations

import random
import secrets

from memstep.core.config import EngineConfig

SEED_BOUND = 2**63  # seeds are msgpack ints in [0, 2**63), like SamplingParams.seed


def engine_seed(cfg: EngineConfig) -> int:
    """The engine-wide seed: the configured one, else one from OS entropy."""
    return secrets.randbelow(SEED_BOUND) if cfg.seed is None else cfg.seed


class RequestSeeds:
    """Draws the seeds of requests that have none; owns the engine's sampling-seed generator.

    Draws happen in the order requests are accepted, so the same engine-wide seed and the same
    arrivals give the same seeds.
    """

    def __init__(self, engine_seed: int):
        self._rng = random.Random(engine_seed)

    def draw(self) -> int:
        return self._rng.randrange(SEED_BOUND)
