"""q4 on the real SmolLM2 (q4 weights with the GGUF's own Q4_1 codes, float32
activations rounded to bf16 at each quantized matmul) against float32, unquantized (whose greedy
text equals Hugging Face's): over the parity test's 8 chat prompts, the first token and its
log-prob, and how far greedy text runs before it parts from float32's.

Measured (64 tokens): first difference at tokens [19, 17, 64, 10, 10, 2, 2, 46], so equal text
on 1 of 8 and 21 tokens in common on average; first tokens equal on 8 of 8, log-prob error at
most 0.040 nats. The issue's bar (equal on 6 of 8) is not met: an error of this size turns the
near-ties of a 135M model's greedy path; llama.cpp on the same file rounds activations to 8 bits
(Q8_1) and parts from float32 likewise.
"""

from __future__ import annotations

import pytest

from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.executors.inprocess import local_engine

NEW_TOKENS = 64
FIRST_LOGPROB_ERROR = 0.1  # nats
MIN_MEAN_COMMON = 10  # tokens of greedy text in common with float32, on average


@pytest.fixture(scope="module")
def q4_engine():
    engine = local_engine(EngineConfig(model="smollm2", max_num_seqs=8, quantization="q4"))
    assert engine.executor.worker.quantization == "q4"
    return engine


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


@pytest.mark.slow  # ~70 s: q4 is opt-in (auto is none) until it meets the quality bar
def test_q4_stays_near_float32(q4_engine, smol_engine, chat_prompts):
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    ours = q4_engine.generate(chat_prompts, params)
    reference = smol_engine.generate(chat_prompts, params)
    common = [common_prefix(a.token_ids, b.token_ids) for a, b in zip(ours, reference, strict=True)]
    assert min(common) >= 1, common  # every first token
    assert sum(common) / len(common) >= MIN_MEAN_COMMON, common
    for a, b in zip(ours, reference, strict=True):
        assert abs(a.logprobs[0][0] - b.logprobs[0][0]) < FIRST_LOGPROB_ERROR
    assert "Paris" in ours[0].text
