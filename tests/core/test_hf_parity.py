"""Greedy output equals Hugging Face transformers' greedy generate on the same GGUF weights."""

from __future__ import annotations

import pytest
import torch
from memstep.core.model_source import shipped_gguf_path
from memstep.core.sampling_params import SamplingParams

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    path = shipped_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
    )
    return model.eval()


def hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        # an explicit mask: the chat prompt contains token 2, which is also the pad id
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers_in_one_continuous_batch(smol_engine, chat_prompts, hf_model):
    assert len({len(p) for p in chat_prompts}) >= 6, "prompts of different lengths"
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = smol_engine.generate(chat_prompts, params)
    for prompt, done in zip(chat_prompts, ours, strict=True):
        assert done.token_ids == hf_greedy(hf_model, prompt)
    assert "Paris" in ours[0].text
