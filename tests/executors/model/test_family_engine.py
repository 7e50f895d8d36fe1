"""Every family through the engine: greedy tokens equal transformers' greedy generate on a tiny
random checkpoint, with chunked prefill, prefix caching and preemption all on the way."""

from __future__ import annotations

import pytest
from tiny_families import FAMILIES, VOCAB, hf_greedy, make_checkpoint, write_tokenizer

from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.executors.process.inprocess import local_engine

pytest.importorskip("transformers")

NEW_TOKENS = 64


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_through_the_engine_matches_transformers(tmp_path, model_type):
    hf = make_checkpoint(model_type, tmp_path)
    write_tokenizer(tmp_path)
    base = [(37 * i) % (VOCAB - 8) + 5 for i in range(30)]  # longer than the windows
    prompts = [base[:c] + [VOCAB - 1 - i, VOCAB - 2] for i, c in enumerate((12, 20, 26))]
    cfg = EngineConfig(
        model=str(tmp_path),
        dtype="float32",
        num_threads=1,
        block_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        num_kv_blocks=40,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = local_engine(cfg)
    try:
        done = engine.generate([base], params) + engine.generate(prompts, params)
        preempted = engine.scheduler.num_preemptions
    finally:
        engine.shutdown()
    assert preempted > 0, "the workload no longer preempts: the test checks less"
    assert sum(c.cached_tokens for c in done) > 0, "no prefix-cache hit"
    for prompt, completion in zip([base, *prompts], done, strict=True):
        assert completion.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
