"""A seeded request gives the same tokens alone and inside a batch of 16 others."""

from __future__ import annotations

from memstep.core.sampling_params import SamplingParams


def test_seeded_request_alone_equals_in_batch(smol_engine, chat_prompts):
    target = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    (alone,) = smol_engine.generate([chat_prompts[2]], target)
    others = [
        SamplingParams(max_tokens=8 + i, temperature=0.5 + i / 10, top_k=20 * (i % 3), seed=i)
        for i in range(16)
    ]
    prompts = [chat_prompts[i % len(chat_prompts)] for i in range(16)]
    results = smol_engine.generate(
        [*prompts[:7], chat_prompts[2], *prompts[7:]], [*others[:7], target, *others[7:]]
    )
    assert results[7].token_ids == alone.token_ids
    # the seed matters: a different seed gives a different sample
    other_seed = SamplingParams(
        max_tokens=24, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True
    )
    (different,) = smol_engine.generate([chat_prompts[2]], other_seed)
    assert different.token_ids != alone.token_ids
