"""Prompt logprobs (SamplingParams.prompt_logprobs, executors/runtime/prompt_scorer.py) on the real
SmolLM2 in float32: each prompt token's score (and rank) is what the model gives it after the
tokens before it, the same whether the prompt is computed in one chunk or several, with
speculation or without, never read from the prefix cache, and the row a chunk holds for the next
is dropped with its request."""

from __future__ import annotations

import pytest

from memstep.core.config import EngineConfig
from memstep.core.request import Request
from memstep.core.sampling_params import SamplingParams
from memstep.executors.process.inprocess import local_engine

TEXT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Spain is"
SMOL = dict(model="smollm2", dtype="float32", num_threads=2)


def scored(engine, prompt: list[int], n: int = 2, **params) -> list[list]:
    asked = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=n, **params)
    return engine.generate([prompt], asked)[0].prompt_logprobs


@pytest.fixture(scope="module")
def whole():
    engine = local_engine(EngineConfig(**SMOL, enable_prefix_caching=True))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompt(whole):
    return whole.tokenizer.encode(TEXT)


def test_each_prompt_token_scores_as_the_next_token_after_the_tokens_before_it(whole, prompt):
    """Against the sampler's logprobs of a reply's first token (another path: the last row of a
    prompt cut before that token), wherever the prompt's token is among that reply's top 20."""
    scores = scored(whole, prompt, n=3)
    assert len(scores) == len(prompt) - 1
    for (chosen, top, rank), token in zip(scores, prompt[1:], strict=True):
        values = [lp for _, lp in top]
        assert len(top) == 3 and values == sorted(values, reverse=True) and chosen <= values[0]
        assert (rank == 1) == (top[0][0] == token) and rank >= 1
    checked = 0
    for k in range(4, len(prompt), 3):
        cut = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
        first = whole.generate([prompt[:k]], cut)[0].logprobs[0]
        alternatives = dict(map(tuple, first[1]))
        order = [tid for tid, _ in first[1]]
        # its rank: its place among the top 20 of that other path, past them where not there
        rank = scores[k - 1][2]
        assert rank == order.index(prompt[k]) + 1 if prompt[k] in order else rank > 20
        if prompt[k] in alternatives:
            assert scores[k - 1][0] == pytest.approx(alternatives[prompt[k]], abs=1e-4)
            checked += 1
    assert checked >= 4, checked


def test_chunks_and_speculation_score_the_prompt_as_one_forward_does(whole, prompt):
    """Chunks of 8 tokens (each chunk's last row held for the next chunk's first token), and an
    ngram-speculating engine (its prompts run in spec steps): the same scores."""
    reference = scored(whole, prompt)
    chunked = local_engine(EngineConfig(**SMOL, max_num_batched_tokens=8))
    try:
        got = scored(chunked, prompt)
    finally:
        chunked.shutdown()
    spec = local_engine(EngineConfig(**SMOL, speculative_method="ngram"))
    try:
        spec_got = scored(spec, prompt)
    finally:
        spec.shutdown()
    for other in (got, spec_got):
        assert len(other) == len(reference)
        for (a, top_a, rank_a), (b, top_b, rank_b) in zip(reference, other, strict=True):
            assert a == pytest.approx(b, abs=1e-4) and rank_a == rank_b
            assert [t for t, _ in top_a] == [t for t, _ in top_b]


def test_a_scored_prompt_is_computed_whole_while_others_hit_the_cache(whole, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    whole.generate([prompt], params)  # the prompt's blocks cached
    asked = whole.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    )
    assert asked[0].cached_tokens == 0 and len(asked[0].prompt_logprobs) == len(prompt) - 1
    assert all(top == [] for _, top, _ in asked[0].prompt_logprobs)
    assert whole.generate([prompt], params)[0].cached_tokens > 0


def test_a_request_dropped_mid_prompt_leaves_no_row_held():
    """Aborted after its first chunk, a request's held row (the chunk's last state, kept for the
    next chunk's first token) goes with it; and with `forget` broken, it stays."""
    engine = local_engine(EngineConfig(**SMOL, max_num_batched_tokens=8))
    try:
        scorer = engine.executor.worker.prompts
        prompt = engine.tokenizer.encode(TEXT)
        rid = engine.add_request(prompt, SamplingParams(max_tokens=4, prompt_logprobs=1))
        engine.step()
        assert rid in scorer._held  # the first chunk's last row, for the second chunk
        engine.abort(rid)
        while engine.has_work():
            engine.step()
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1))  # a step after the abort
        assert scorer._held == {} and scorer.requests.scoring == set()
        scorer.forget = lambda request_id: None  # broken on purpose: the row outlives its request
        rid = engine.add_request(prompt, SamplingParams(max_tokens=4, prompt_logprobs=1))
        engine.step()
        engine.abort(rid)
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1))
        assert rid in scorer._held
        # a leak report would name it: one hidden state (not a vocabulary of logits)
        width = engine.executor.worker.model.cfg.hidden_size
        held = engine.executor.worker.holdings()["prompt_scorer.held"]
        assert held == (1, 4 * width, f"[1, {width}] float32"), held
    finally:
        engine.shutdown()


def test_scores_computed_again_after_a_preemption_are_kept_once():
    req = Request("r", [5, 6, 7, 8, 9], SamplingParams(prompt_logprobs=0), lambda ids: "")
    assert req.scores_prompt
    req.add_prompt_logprobs(1, [[-1.0, []], [-2.0, []]])
    req.add_prompt_logprobs(1, [[-9.0, []], [-9.0, []], [-3.0, []]])  # recomputed from the start
    req.add_prompt_logprobs(5, [[-9.0, []]])  # a gap: not taken
    assert [e[0] for e in req.prompt_logprobs] == [-1.0, -2.0, -3.0] and req.scores_prompt
    req.add_prompt_logprobs(4, [[-4.0, []]])
    assert not req.scores_prompt and len(req.prompt_logprobs) == 4
