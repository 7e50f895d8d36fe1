"""Synthetic traffic: random sampling parameters, waves of requests whose concurrency climbs
1, 2, 4, ... up to a cap (the GPU memory test and benchmark use it), and staggered arrivals
(a few requests alone for some steps, then the rest: other batch-mates than all at once).
"""

from __future__ import annotations

import random

from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams


def random_params(rng: random.Random) -> SamplingParams:
    """Short requests (2-24 tokens) with every sampling feature in play: greedy or a random
    temperature, top-p, top-k, min-p, repetition penalty, logprobs, a seed."""
    greedy = rng.random() < 0.3
    return SamplingParams(
        max_tokens=rng.randint(2, 24),
        temperature=0.0 if greedy else rng.uniform(0.2, 1.5),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        top_k=rng.choice([0, 0, 20, 200]),
        min_p=rng.choice([0.0, 0.0, 0.05]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
        logprobs=rng.choice([0, 0, 0, 3]),
        seed=rng.randrange(2**32),
        ignore_eos=True,
    )


def rising_waves(engine: Engine, num_requests: int, max_concurrency: int, seed: int) -> int:
    """Waves of `random_params` requests (prompts of 1-200 random tokens) whose size doubles up
    to `max_concurrency` and stays there; half of each wave joins one step late, so mixed steps
    occur. Each wave runs to the end. Returns the number of steps run."""
    rng = random.Random(seed)
    vocab = engine.model_cfg.vocab_size
    added = steps = 0
    wave = 1
    while added < num_requests:
        size = min(wave, num_requests - added)
        for i in range(size):
            if i == size // 2 and i > 0:
                engine.step()
                steps += 1
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 200))]
            engine.add_request(prompt, random_params(rng))
            added += 1
        while engine.has_work():
            engine.step()
            steps += 1
        wave = min(2 * wave, max_concurrency)
    return steps


def staggered(
    engine: Engine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    first: int = 3,
    steps: int = 3,
    request_ids: list[str] | None = None,
) -> list[list[int]]:
    """The first `first` prompts run `steps` steps alone, then the rest join; runs until idle.
    Each prompt's generated tokens, in order."""
    names: list[str | None] = list(request_ids) if request_ids else [None] * len(prompts)
    tokens: dict[str, list[int]] = {}

    def add(i: int) -> str:
        return engine.add_request(prompts[i], params[i], request_id=names[i])

    def step() -> None:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    ids = [add(i) for i in range(first)]
    for _ in range(steps):
        step()
    ids += [add(i) for i in range(first, len(prompts))]
    while engine.has_work():
        step()
    return [tokens[i] for i in ids]
