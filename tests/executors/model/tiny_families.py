"""Tiny random checkpoints of each family, made offline with transformers (2 layers, hidden 64),
and memstep's logits of a prompt over them, for the family tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from memstep.core.model_config import ModelConfig
from memstep.core.model_source import model_config, resolve
from memstep.events.plan import SeqPlan
from memstep.executors.model import kv_cache
from memstep.executors.model.llama import LlamaModel
from memstep.executors.model.weights import load_weights
from memstep.executors.process.assemble import pick_backend
from memstep.executors.runtime.batch_builder import build_batch

VOCAB = 256
WINDOW = 8  # every windowed family's: the long prompt is longer
DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_SCALING = dict(
    rope_type="longrope",
    short_factor=[1.0 + 0.2 * i for i in range(6)],
    long_factor=[3.0 + 0.2 * i for i in range(6)],
    original_max_position_embeddings=128,  # above the prompts: the short factors (as
    # transformers rotates a whole sequence by the long ones past it, a cache cannot)
)
# model_type -> what the family adds to the tiny dimensions (each family's own pieces on)
FAMILIES = {
    "qwen2": {},
    "qwen3": dict(head_dim=16),
    "mistral": dict(sliding_window=WINDOW),
    "gemma3_text": dict(
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,
    ),
    "phi3": dict(
        partial_rotary_factor=0.75, rope_scaling=_SCALING, original_max_position_embeddings=128
    ),
    "qwen3_moe": dict(
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


def make_checkpoint(
    model_type: str,
    folder: Path,
    dtype: torch.dtype = torch.float32,
    shard_size: str = "5GB",
    **overrides,
):
    """A tiny `model_type` checkpoint saved in `folder` (safetensors in `dtype`, in shards of
    `shard_size`; config fields `overrides` changed; llama: the tiny dimensions alone), every
    parameter seeded normal noise (norms around 1, so that a dropped norm or offset shows);
    returns the transformers model, eval mode, float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **(DIMS | FAMILIES.get(model_type, {}) | overrides))
    gen = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.3 * noise if name.endswith("norm.weight") else 0.15 * noise)
    model.to(dtype).save_pretrained(folder, max_shard_size=shard_size)
    return model.float()


def prompts() -> list[list[int]]:
    """Three prompts: short, medium, and longer than the windows."""
    return [
        [(7 * i + 3) % (VOCAB - 3) + 3 for i in range(5)],
        [(11 * i + 5) % (VOCAB - 3) + 3 for i in range(13)],
        [(13 * i + 1) % (VOCAB - 3) + 3 for i in range(80)],
    ]


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer.json of the checkpoint's ids (a tiny checkpoint has none; the
    engine is driven with token ids, the tokenizer only turns them into text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": None}))


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt` (on the model's device)."""
    with torch.no_grad():
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def one_minus_cosine(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """1 - the cosine of two logits tensors, flattened (ours in float32 first)."""
    cosine = torch.nn.functional.cosine_similarity(ours.flatten().float(), theirs.flatten(), dim=0)
    return 1.0 - cosine.item()


def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt], device=model.device)).logits[0].float()


def memstep_model(
    folder: Path,
    cfg: ModelConfig | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[LlamaModel, list]:
    """memstep's model of the checkpoint at `folder` (a folder or a .gguf; its config read, or
    `cfg` instead) on
    `device` in `dtype`, its backend chosen as the engine does, and a KV cache of 64 pages of
    4 tokens."""
    cfg = cfg or model_config(resolve(str(folder)))
    where = torch.device(device)
    weights = load_weights(resolve(str(folder)), cfg, dtype, where)
    model = LlamaModel(cfg, weights, 512, pick_backend(where, cfg, weights, dtype))
    shape = (64, 4, cfg.num_kv_heads, cfg.head_dim)
    return model, kv_cache.allocate(cfg.num_layers, shape, dtype, where)


def memstep_logits(model: LlamaModel, kv, prompt: list[int], decoded: int = 6) -> torch.Tensor:
    """[len(prompt), vocab] logits: the prompt but its last `decoded` tokens in chunks of 16,
    then those one token a step (decode attention), each step's rows' logits."""
    table = list(range(64))
    rows: list[torch.Tensor] = []
    cut = max(1, len(prompt) - decoded)
    steps = [(s, prompt[s : min(s + 16, cut)]) for s in range(0, cut, 16)]
    steps += [(p, [prompt[p]]) for p in range(cut, len(prompt))]
    with torch.inference_mode():
        for start, tokens in steps:
            seq = SeqPlan("s", start, tokens, table, True, 0, len(prompt))
            batch, _ = build_batch([(seq, tokens)], 4, kv[0][0].device)
            rows.append(model.logits(model.forward(batch, kv)))
    return torch.cat(rows)
