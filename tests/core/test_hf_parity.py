"""Greedy output equals Hugging Face transformers' greedy generate on the same GGUF weights."""

from __future__ import annotations

import json

import pytest
import torch

from memstep.core.model_source import shipped_gguf_path
from memstep.core.sampling_params import SamplingParams
from memstep.executors.process.inprocess import local_engine

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
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = smol_engine.generate(chat_prompts, params)
    for prompt, done in zip(chat_prompts, ours, strict=True):
        assert done.token_ids == hf_greedy(hf_model, prompt)
    assert "Paris" in ours[0].text


def test_hugging_face_folder_loads_and_matches_the_gguf(
    hf_model, smol_engine, chat_prompts, tmp_path
):
    import transformers
    from safetensors.torch import save_file

    from memstep.core.config import EngineConfig

    path = shipped_gguf_path()
    # a GGUF-loaded model refuses save_pretrained, so write the folder's files directly
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(tmp_path)
    folder_engine = local_engine(EngineConfig(model=str(tmp_path), dtype="float32", max_num_seqs=4))
    assert folder_engine.tokenizer.encode("Hello world!") == smol_engine.tokenizer.encode(
        "Hello world!"
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ours = folder_engine.generate(chat_prompts[:3], params)
    reference = smol_engine.generate(chat_prompts[:3], params)
    assert [c.token_ids for c in ours] == [c.token_ids for c in reference]


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from memstep.core.model_config import PRESETS
    from memstep.executors.model.layers.rotary import rope_inv_freq

    cfg = PRESETS["llama-3.2-1b"]
    hf_cfg = LlamaConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rope_scaling=dict(cfg.rope_scaling or {}),
        max_position_embeddings=cfg.max_context,
    )
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(cfg), want.float(), rtol=1e-5, atol=1e-7)
