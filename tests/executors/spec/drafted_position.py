"""The chi-square test of speculation at temperature 1, shared by the chain's (test_spec_eagle)
and the tree's (test_spec_tree): a point of a greedy chat reply where the next token is nearly
certain and the one after it is not, the second reply tokens of many seeded runs from there,
and their chi-square against the target's own distribution."""

from __future__ import annotations

import collections
import math

from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.executors.process.inprocess import local_engine

RUNS = 640
CRITICAL = {2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5}  # chi-square at p = 0.001, by degrees of freedom


def find_position(chat_prompts: list) -> tuple[list[int], int, dict[int, float]]:
    """(prompt, its nearly certain next token, the target's distribution of the one after):
    runs from the prompt share their first token, and their second (drafted) token has a
    spread distribution, the target's own (its logprobs at temperature 1)."""
    plain = local_engine(EngineConfig(max_num_seqs=8))
    replies = plain.generate(
        chat_prompts, SamplingParams(temperature=0.0, max_tokens=24, logprobs=5)
    )
    best = None
    for prompt, reply in zip(chat_prompts, replies, strict=True):
        for i in range(len(reply.token_ids) - 1):
            sure = math.exp(reply.logprobs[i][0])
            top = {int(t): math.exp(lp) for t, lp in reply.logprobs[i + 1][1]}
            spread = sorted(top.values())[-2] if len(top) > 1 else 0.0  # the runner-up's share
            if sure > 0.9 and sum(top.values()) > 0.8 and (best is None or spread > best[0]):
                best = (spread, prompt + reply.token_ids[:i], reply.token_ids[i], top)
    assert best is not None and best[0] > 0.1, "no point with a spread next-but-one token"
    return best[1], best[2], best[3]


def second_tokens(
    engine, prompt: list[int], max_tokens: int
) -> tuple[collections.Counter, int, list]:
    """Over RUNS seeds at temperature 1: the second reply tokens of the runs whose first was
    the most common one, that first token, and every completion."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s) for s in range(RUNS)]
    done = engine.generate([prompt] * RUNS, params)
    firsts = collections.Counter(c.token_ids[0] for c in done)
    mode = firsts.most_common(1)[0][0]
    seconds = collections.Counter(c.token_ids[1] for c in done if c.token_ids[0] == mode)
    return seconds, mode, done


def chi_square(counts: collections.Counter, top: dict[int, float]) -> tuple[float, int]:
    """The statistic and its degrees of freedom, over the tokens expected 5 times or more and
    one bin for the rest."""
    n = sum(counts.values())
    kept = {t: p for t, p in top.items() if p * n >= 5}
    observed = [counts.get(t, 0) for t in kept] + [n - sum(counts.get(t, 0) for t in kept)]
    expected = [p * n for p in kept.values()] + [(1.0 - sum(kept.values())) * n]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    return stat, len(kept)
