"""Prefix caching: greedy fp32 output is the same with and without it, on the real model for
prefixes shared inside a block, at block edges and whole (and an idle engine holds no page, only
cached ones); on the tiny random model with preemption, draft-model speculation and fp8 pages."""

from __future__ import annotations

import pytest

from memstep.core.config import EngineConfig
from memstep.core.model_source import model_config, resolve
from memstep.core.sampling_params import SamplingParams
from memstep.core.tokenizer import load_tokenizer
from memstep.executors.process.inprocess import local_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BASE = dict(model="smollm2", dtype="float32", quantization="none", num_threads=2)


def shared_prompts(tokenizer, block_size: int) -> tuple[list[int], list[list[int]]]:
    """A base prompt, and prompts sharing its first tokens: inside a block, at block edges, the
    whole prompt, and the whole prompt cut at a block edge."""
    base = tokenizer.encode(
        "You are a careful assistant for a library. Answer in one short sentence, cite the "
        "shelf, and never invent a book. The catalogue lists atlases, novels and cookbooks. "
        "Atlases are on the first floor, novels on the second, cookbooks beside the cafe; the "
        "reading room closes at six and the children's corner at five."
    )
    assert len(base) > 4 * block_size
    tail = tokenizer.encode(" Where are the atlases?")
    cuts = [block_size // 2, 2 * block_size + 3, 2 * block_size, 3 * block_size]
    variants = [base[:cut] + tail for cut in cuts]
    variants += [list(base), base[: 4 * block_size]]
    return base, variants


def expected_hit(base: list[int], prompt: list[int], block_size: int) -> int:
    """Tokens of full blocks shared with `base`, leaving at least one token to compute."""
    common = zip(base, prompt, strict=False)
    shared = next((i for i, (a, b) in enumerate(common) if a != b), min(len(base), len(prompt)))
    return min(shared // block_size, (len(prompt) - 1) // block_size) * block_size


def run(cfg: EngineConfig, first: list[list[int]], then: list[list[int]], params=GREEDY):
    """Serve `first`, then `then` once `first` is done; the completions and the engine's pages."""
    engine = local_engine(cfg)
    try:
        done = engine.generate(first, params) + engine.generate(then, params)
        engine.blocks.check()
        engine.blocks.check_idle()
        return done, engine.blocks.num_cached, engine.last_memory
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def prompts():
    source = resolve("smollm2", 0)
    mc = model_config(source)
    tokenizer = load_tokenizer(source, mc.vocab_size, mc.eos_token_ids)
    return shared_prompts(tokenizer, EngineConfig().block_size)


def test_greedy_output_is_identical_with_and_without_caching(prompts):
    base, variants = prompts
    cached, num_cached, memory = run(EngineConfig(**BASE), [base], variants)
    plain, none_cached, _ = run(EngineConfig(**BASE, enable_prefix_caching=False), [base], variants)
    assert [c.token_ids for c in cached] == [c.token_ids for c in plain]
    bs = EngineConfig().block_size
    hits = [expected_hit(base, v, bs) for v in variants]
    assert [c.cached_tokens for c in cached[1:]] == hits
    assert hits[0] == 0 and all(h > 0 for h in hits[1:])  # inside the first block: no hit
    assert {c.cached_tokens for c in plain} == {0} and cached[0].cached_tokens == 0
    # idle: nothing held, the reusable pages counted apart from held ones
    assert num_cached > 0 and none_cached == 0
    assert memory.kv_pages_used == 0 and memory.kv_pages_cached == num_cached


TINY = dict(model="random:tiny", dtype="float32", num_threads=1, block_size=4)


def tiny_prompts() -> tuple[list[int], list[list[int]]]:
    """Token ids for the tiny random model (vocabulary 512), shared as `shared_prompts` does."""
    base = [(37 * i) % 500 + 5 for i in range(30)]
    tails = [[501 + i, 502 + i, 503] for i in range(4)]
    cuts = [2, 11, 8, 16]
    return base, [base[:c] + t for c, t in zip(cuts, tails, strict=True)] + [base, base[:24]]


def test_preemption_with_shared_pages_keeps_the_output():
    base, variants = tiny_prompts()
    tight = dict(TINY, num_kv_blocks=24, max_num_seqs=6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = local_engine(EngineConfig(**tight))
    try:
        cached = engine.generate([base], params) + engine.generate(variants, params)
        preempted = engine.scheduler.num_preemptions
        engine.blocks.check_idle()
    finally:
        engine.shutdown()
    plain, _, _ = run(EngineConfig(**tight, enable_prefix_caching=False), [base], variants, params)
    assert preempted > 0, "the workload no longer preempts: the test checks nothing"
    assert sum(c.cached_tokens for c in cached) > 0
    assert [c.token_ids for c in cached] == [c.token_ids for c in plain]


def test_draft_model_catches_up_over_reused_pages():
    """The draft's own KV for reused pages was never written: it recomputes from position 0, so
    drafts, acceptance and output match a run without caching."""
    base, variants = tiny_prompts()
    spec = dict(TINY, speculative_method="draft", draft_layers=1, num_speculative_tokens=3)
    spec["speculative_auto_disable"] = False  # the two runs' kinds from step counts alone
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cached, _, _ = run(EngineConfig(**spec), [base], variants, params)
    plain, _, _ = run(EngineConfig(**spec, enable_prefix_caching=False), [base], variants, params)
    assert [c.token_ids for c in cached] == [c.token_ids for c in plain]
    assert sum(c.cached_tokens for c in cached) > 0
    assert [c.num_accepted for c in cached] == [c.num_accepted for c in plain]
    assert sum(c.num_accepted for c in cached) > 0


def test_fp8_pages_are_reused_like_any_other():
    base, variants = tiny_prompts()
    fp8 = dict(TINY, kv_cache_dtype="fp8")
    cached, _, _ = run(EngineConfig(**fp8), [base], variants)
    plain, _, _ = run(EngineConfig(**fp8, enable_prefix_caching=False), [base], variants)
    assert sum(c.cached_tokens for c in cached) > 0
    assert [c.token_ids for c in cached] == [c.token_ids for c in plain]
