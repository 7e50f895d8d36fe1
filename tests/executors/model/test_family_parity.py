"""Every family's logits equal transformers' on a tiny random checkpoint (float32, CPU), and a
planted mistake in each family's own piece moves them far past the tolerance."""

from __future__ import annotations

import attrs
import pytest
from tiny_families import (
    FAMILIES,
    hf_logits,
    make_checkpoint,
    memstep_logits,
    memstep_model,
    prompts,
)

from memstep.core.model_source import hf_model_config

pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max abs over every position's logits, float32
# each family's own piece, planted wrong: the ModelConfig field changed and what that means
PLANTED = {
    "qwen2": ({"qkv_bias": False}, "QKV bias dropped"),
    "qwen3": ({"qk_norm": False}, "q/k norm skipped"),
    "mistral": ({"layer_windows": ()}, "the window ignored"),
    "gemma3_text": ({"norm_offset": 0.0}, "(1 + w) dropped"),
    "phi3": ({"rope_scaling": None}, "LongRoPE ignored"),
    "qwen3_moe": ({"experts_per_token": 1}, "experts routed by the wrong top-k"),
    "mixtral": ({"norm_topk_prob": False}, "expert weights not renormalised"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict = {}

    def get(model_type: str):
        if model_type not in made:
            folder = tmp_path_factory.mktemp(model_type)
            made[model_type] = folder, make_checkpoint(model_type, folder)
        return made[model_type]

    return get


def worst_error(folder, hf, cfg=None) -> float:
    model, kv = memstep_model(folder, cfg)
    errors = [(hf_logits(hf, p) - memstep_logits(model, kv, p)).abs().max() for p in prompts()]
    return max(errors).item()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_logits_match_transformers(checkpoints, model_type):
    folder, hf = checkpoints(model_type)
    cfg = hf_model_config(folder)
    if cfg.layer_windows:
        assert len(prompts()[-1]) > 2 * max(cfg.layer_windows), "a prompt past the window"
    assert worst_error(folder, hf) < TOLERANCE


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_planted_mistake_fails_the_check(checkpoints, model_type):
    folder, hf = checkpoints(model_type)
    change, what = PLANTED[model_type]
    wrong = attrs.evolve(hf_model_config(folder), **change)
    assert worst_error(folder, hf, wrong) > 100 * TOLERANCE, f"{what} went unseen"


def test_a_sharded_bfloat16_folder_loads_the_shards_its_index_names(tmp_path):
    """Shards named by model.safetensors.index.json, in bfloat16; a stale file beside them with
    the same tensor names (zeros) must not be read."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    make_checkpoint("qwen3", tmp_path, dtype=torch.bfloat16, shard_size="100KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(shards) > 1
    stale = {k: torch.zeros_like(v) for k, v in load_file(str(shards[0])).items()}
    save_file(stale, str(tmp_path / "consolidated.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert worst_error(tmp_path, hf) < TOLERANCE


def test_a_multimodal_gemma3_checkpoint_serves_its_text_model(tmp_path):
    """Gemma 3's released checkpoints (4B and up) wrap the text model with a vision tower:
    memstep reads `text_config` and the `language_model.` tensors, and its logits are the
    wrapper's on text."""
    import torch
    from tiny_families import DIMS, FAMILIES
    from transformers import AutoConfig, Gemma3ForConditionalGeneration

    text = {k: v for k, v in DIMS.items() if not k.endswith("token_id")}
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    cfg = AutoConfig.for_model(
        "gemma3",
        text_config=text | FAMILIES["gemma3_text"],
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=255,
        boi_token_index=253,
        eoi_token_index=254,
    )
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    assert hf_model_config(tmp_path).architecture == "gemma3"
    assert worst_error(tmp_path, hf) < TOLERANCE
