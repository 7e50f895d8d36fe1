"""Every family on CUDA in bfloat16 against transformers on the same GPU and the same tiny random
checkpoint (`-m gpu`): greedy tokens identical for the first 32 on at least 15 of 16 prompts,
through the engine, where a prompt whose texts part at a token the reference ranked in its top 3
counts as agreeing (vLLM's rule for half-precision runs); each prompt's logits at cosine >= 0.999
(every position's >= 0.995).

The reference is transformers' float32 forward of the checkpoint's bfloat16 weights, not its
bfloat16 forward: a tiny random model amplifies rounding, and transformers' own bfloat16 run
routes some tokens of a mixture of experts to other experts than its float32 run does (Mixtral's
80-token prompt: one position at cosine 0.887 against float32, where memstep's is 0.999).

A mixture of experts in bfloat16 cannot meet the dense bounds against float32, whoever runs it:
where an activation rounds across a router's near-tie the token goes to another expert. On the
CPU over these tiny checkpoints, 19 prompts, the mean of 1 - cosine against transformers'
float32 forward was 5.0e-4 (qwen3_moe) and 2.5e-3 (mixtral) for transformers' own bfloat16
forward, 8.0e-4 and 1.6e-3 for memstep's, with single rows as low as 0.55 for both; scaling the
routers up 16-fold did not remove it. So for MOE families the bound is transformers' own
bfloat16 run on the same GPU: memstep's mean 1 - cosine at most twice its, and at least as many
greedy prompts agreeing as its, less one."""

from __future__ import annotations

import pytest
import torch
from tiny_families import (
    FAMILIES,
    VOCAB,
    hf_greedy,
    hf_logits,
    make_checkpoint,
    memstep_logits,
    memstep_model,
    one_minus_cosine,
    prompts,
    write_tokenizer,
)

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import StepFinished, is_leak
from memstep.executors.process.inprocess import local_engine
from memstep.executors.process.remote import ProcessExecutor

pytestmark = pytest.mark.gpu
NEW_TOKENS = 32
TOP_K = 3  # of a vocabulary of 256: a token picked at random is in it 1.2% of the time
MOE = ("qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("transformers")


def hf_reference(folder, dtype: torch.dtype = torch.float32):
    """transformers in `dtype` over the folder's bfloat16 weights, on the GPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).cuda().eval()


def sixteen_prompts() -> list[list[int]]:
    """Lengths 3 to 78: short ones, and most past the windowed families' windows."""
    return [[(31 * i + 7 * j) % (VOCAB - 3) + 3 for j in range(3 + 5 * i)] for i in range(16)]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_bf16_through_the_engine(cuda, tmp_path, model_type):
    make_checkpoint(model_type, tmp_path, dtype=torch.bfloat16)
    write_tokenizer(tmp_path)
    hf = hf_reference(tmp_path)
    cfg = EngineConfig(model=str(tmp_path), dtype="bfloat16", device="cuda", max_num_seqs=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = local_engine(cfg)
    try:
        done = engine.generate(sixteen_prompts(), params)
    finally:
        engine.shutdown()
    verdicts = [agrees(hf, p, c.token_ids) for p, c in zip(sixteen_prompts(), done, strict=True)]
    print(f"{model_type}: {verdicts}")
    same = sum(v != "differs" for v in verdicts)
    needed = 15
    if model_type in MOE:  # transformers' own bfloat16 run against its float32 one
        half = hf_reference(tmp_path, torch.bfloat16)
        theirs = [agrees(hf, p, hf_greedy(half, p, NEW_TOKENS)) for p in sixteen_prompts()]
        print(f"{model_type}, transformers in bfloat16: {theirs}")
        needed = min(needed, sum(v != "differs" for v in theirs) - 1)
    assert same >= needed, f"{model_type}: {same} of 16 prompts' greedy tokens agree"


def agrees(hf, prompt: list[int], ours: list[int]) -> str:
    """ "same" where memstep's greedy tokens are the reference's; "close" where they part at a
    token the reference ranked in its top TOP_K there (vLLM's `check_logprobs_close` rule: a
    bfloat16 run may pick a token the float32 run ranked close, and from there the texts part);
    else "differs"."""
    theirs = hf_greedy(hf, prompt, NEW_TOKENS)
    if theirs == ours:
        return "same"
    at = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
    logits = hf_logits(hf, prompt + theirs[:at])[-1]
    return "close" if ours[at] in logits.topk(TOP_K).indices.tolist() else "differs"


@pytest.mark.parametrize("model_type", FAMILIES)
def test_logits_cosine_bf16(cuda, tmp_path, model_type):
    make_checkpoint(model_type, tmp_path, dtype=torch.bfloat16)
    hf = hf_reference(tmp_path)
    model, kv = memstep_model(tmp_path, device="cuda", dtype=torch.bfloat16)
    if model_type in MOE:
        half = hf_reference(tmp_path, torch.bfloat16)
        ours_off, theirs_off = [], []
        for prompt in prompts() + sixteen_prompts():
            reference = hf_logits(hf, prompt)
            ours_off.append(one_minus_cosine(memstep_logits(model, kv, prompt), reference))
            theirs_off.append(one_minus_cosine(hf_logits(half, prompt), reference))
        ours_mean, theirs_mean = sum(ours_off) / len(ours_off), sum(theirs_off) / len(theirs_off)
        print(
            f"{model_type}: mean 1 - cosine {ours_mean:.2e}, transformers' bf16 {theirs_mean:.2e}"
        )
        assert ours_mean <= 2 * theirs_mean, (model_type, ours_mean, theirs_mean)
        return
    for prompt in prompts():
        ours, theirs = memstep_logits(model, kv, prompt), hf_logits(hf, prompt)
        whole = torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0)
        rows = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
        print(f"{model_type} {len(prompt)} tokens: {whole.item():.5f}, rows >= {rows.min():.5f}")
        assert whole.item() >= 0.999, f"{model_type}: cosine {whole.item():.5f}"
        assert rows.min().item() >= 0.995, f"{model_type}: a row at {rows.min().item():.5f}"


@pytest.mark.parametrize("model_type", FAMILIES)
def test_reserved_memory_after_warmup_and_capture_is_within_the_plan(cuda, tmp_path, model_type):
    """Each family served as in production (the executor in a process of its own, graphs
    captured): the allocator's reserved peak after warm-up and capture stays within the memory
    plan's predicted peak, and 48 requests of mixed lengths served after it change neither the
    reserved bytes nor the allocator's segments, with no leak report."""
    make_checkpoint(model_type, tmp_path, dtype=torch.bfloat16)
    write_tokenizer(tmp_path)
    cfg = EngineConfig(
        model=str(tmp_path),
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=16,
        max_model_len=256,
        num_kv_blocks=256,
    )
    records: list = []
    engine = Engine(cfg, ProcessExecutor, sinks=[records.append])
    try:
        figures = engine.captured
        print(f"{model_type}: {figures}")
        assert figures.reserved_peak_bytes <= figures.predicted_peak_bytes, figures
        assert figures.reserved_within_plan
        prompts48 = [
            [(13 * i + 5 * j) % (VOCAB - 3) + 3 for j in range(4 + 3 * i)] for i in range(48)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        done = engine.generate(prompts48, params)
        assert all(len(c.token_ids) == 40 for c in done)
        steps = [r.memory for r in records if isinstance(r, StepFinished)]
        assert len(steps) > 20
        shape = {(m.reserved_bytes, m.num_segments) for m in steps}
        assert shape == {(steps[0].reserved_bytes, steps[0].num_segments)}, shape
        assert steps[0].reserved_bytes <= figures.predicted_peak_bytes
        assert [r for r in records if is_leak(r)] == []
    finally:
        engine.shutdown()
