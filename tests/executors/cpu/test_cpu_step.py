"""The CPU's one-call decode step (executors/cpu/decode_step.py) on the real SmolLM2 q4:
taken for decode steps, and every bit of its output (log-probs included) is the
kernel-by-kernel forward's, with
the OpenMP pool woken or not and on one thread or two, in float32 products and in bfloat16."""

from __future__ import annotations

import pytest
import torch

from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.executors.cpu import backend as cpu_backend
from memstep.executors.cpu import decode_step as cpu_step
from memstep.executors.cpu import kernels as cpu_kernels
from memstep.executors.cpu.decode_step import DecodeStep
from memstep.executors.model import torch_backend
from memstep.executors.process.inprocess import local_engine

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Write a haiku about the sea."]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)


def q4_engine(precision: str):
    # no prefix cache: the same prompts run again must be prefilled the same way
    cfg = EngineConfig(model="smollm2", quantization="q4", max_num_seqs=4)
    return local_engine(cfg.replace(enable_prefix_caching=False, matmul_precision=precision))


# bfloat16 products run on a CPU without AVX512-BF16 too, a product at a time
@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request):
    return q4_engine(request.param)


def outputs(engine) -> list[tuple[list[int], list[list]]]:
    return [(c.token_ids, c.logprobs) for c in engine.generate(PROMPTS, PARAMS)]


def test_a_decode_step_in_one_call_gives_the_kernel_by_kernel_bits(engine, monkeypatch):
    model = engine.executor.worker.model
    assert model.backend.one_call is not None  # the q4 model's layers in C
    calls = []
    step = DecodeStep.__call__
    monkeypatch.setattr(DecodeStep, "__call__", lambda *a: calls.append(1) or step(*a))
    one_call = outputs(engine)
    assert len(calls) >= PARAMS.max_tokens - 1  # the decode steps; prefills went kernel by kernel
    monkeypatch.setattr(DecodeStep, "rows", staticmethod(lambda batch, caches: None))
    assert outputs(engine) == one_call
    # the comparison sees a difference of rounding: torch's RMSNorm kernel by kernel parts
    monkeypatch.setattr(model.backend, "norm", torch_backend.rms_norm)
    assert outputs(engine) != one_call


def test_its_bits_do_not_depend_on_the_pool(engine, monkeypatch):
    reference = outputs(engine)  # the pool as the process has it
    threads = torch.get_num_threads()
    try:
        for count, work in ((2, 0), (1, 0), (2, 1 << 62)):  # every stage on the pool; one; none
            torch.set_num_threads(count)
            cpu_kernels.set_parallel_min(work)
            assert outputs(engine) == reference, (count, work)
    finally:
        torch.set_num_threads(threads)
        cpu_kernels.set_parallel_min(cpu_kernels.parallel_min())


def test_verify_steps_take_it_with_the_same_bits(monkeypatch):
    """A speculative verify step whose sequences feed as many tokens each: its queries are
    decode rows of their own on the CPU, so it runs in one call too."""
    cfg = EngineConfig(model="smollm2", quantization="q4", max_num_seqs=4)
    cfg = cfg.replace(speculative_method="eagle", num_speculative_tokens=2)
    spec = local_engine(cfg.replace(enable_prefix_caching=False))
    widths = []
    step = DecodeStep.__call__
    monkeypatch.setattr(
        DecodeStep, "__call__", lambda s, h, *a: widths.append(h.shape[0]) or step(s, h, *a)
    )
    one_call = outputs(spec)
    assert 3 * len(PROMPTS) in widths  # a verify step: each token and its two drafts
    monkeypatch.setattr(DecodeStep, "rows", staticmethod(lambda batch, caches: None))
    assert outputs(spec) == one_call


def test_a_cache_made_anew_is_addressed_anew(engine):
    """The step keeps the caches' addresses between calls; any cache that moved (a worker's
    cache allocated again, say after profiling) gets its addresses taken again."""
    step = engine.executor.worker.model.backend.one_call
    first = [(torch.zeros(4), torch.zeros(4)) for _ in range(2)]
    keys, values = step._cache_pointers(first)
    assert list(keys) == [k.data_ptr() for k, _ in first]
    moved = [first[0], (torch.zeros(4), first[1][1])]  # only layer 1's keys moved
    keys, values = step._cache_pointers(moved)
    assert list(keys) == [k.data_ptr() for k, _ in moved]
    assert list(values) == [v.data_ptr() for _, v in moved]


def test_bf16_products_reach_every_matmul_but_the_head(engine):
    """The setting is the worker's and the model's: bfloat16 products move the log-probs, and
    the head (the tied Q8_0 embedding) keeps float32's."""
    worker = engine.executor.worker
    assert worker.model.backend.bf16_products == (worker.matmul_precision == "bfloat16")
    other = q4_engine("float32" if worker.model.backend.bf16_products else "bfloat16")
    assert outputs(other) != outputs(engine)
    assert other.executor.worker.model.head is not None
    engine_head, other_head = worker.model.head, other.executor.worker.model.head
    x = torch.randn(3, worker.model_cfg.hidden_size)
    assert torch.equal(engine_head(x), other_head(x))


def test_a_token_read_in_a_prompt_gets_the_bits_it_decoded_with(engine, monkeypatch):
    """Every operation of a q4 model on the CPU is row by row (the matmul kernels for any
    number of rows, each query attended as a decode row), so a prompt carrying a run's first
    tokens continues with that run's tokens and log-probs to the bit: what preemption by
    recompute and a server resumed from its log rely on."""
    text = "Tell me, in a few plain words and without any preamble at all, why the sea is salty, "
    prompt = engine.tokenizer.encode(text + "and why rivers that run into it are not.")
    assert len(prompt) >= cpu_step.ONE_CALL_ROWS, "read kernel by kernel, decoded in one call"
    run = engine.generate([prompt], PARAMS)[0]
    cut = 5
    again = engine.generate(
        [prompt + run.token_ids[:cut]],
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=5),
    )[0]
    assert again.token_ids == run.token_ids[cut:]
    assert again.logprobs == run.logprobs[cut:]
    # broken on purpose: a prompt's queries attended together by torch, as before
    attend = cpu_backend.attention
    monkeypatch.setattr(
        cpu_backend, "attention", lambda *a, **k: attend(*a, **{**k, "queries_alone": False})
    )
    moved = engine.generate(
        [prompt + run.token_ids[:cut]],
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=5),
    )[0]
    assert moved.logprobs != run.logprobs[cut:]
