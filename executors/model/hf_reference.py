"""A Hugging Face `LlamaForCausalLM` over memstep's own weight tensors, for parity tests and
benchmarks: the fused `wqkv` and `w_gate_up` are split back into views (no copy), so both
engines read the same memory. Needs `transformers`.
"""

from __future__ import annotations

import inspect

import torch

from memstep.core.model_config import ModelConfig
from memstep.executors.model.weights import HF_LAYER_NAMES, Weights


def hf_config(cfg: ModelConfig):
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
        rope["rope_type"] = rope.pop("type", rope.get("rope_type"))
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_eps,
        max_position_embeddings=max(cfg.max_context, 8192),
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=None,
        pad_token_id=0,
    )
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        kwargs["rope_parameters"] = rope
    else:  # transformers 4.x
        kwargs["rope_theta"] = cfg.rope_theta
        kwargs["rope_scaling"] = cfg.rope_scaling
    return LlamaConfig(**kwargs)


def hf_state_dict(weights: Weights, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """memstep names and fused layouts -> Hugging Face names, as views of the same storage."""
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    state_dict = {"model.embed_tokens.weight": weights["embed"]}
    state_dict["model.norm.weight"] = weights["norm"]
    state_dict["lm_head.weight"] = weights.get("lm_head", weights["embed"])
    for i in range(cfg.num_layers):
        p, hf = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = weights[p + "wqkv"].split([nq, nkv, nkv], dim=0)
        gate, up = weights[p + "w_gate_up"].chunk(2, dim=0)
        parts = {"q": q, "k": k, "v": v, "gate": gate, "up": up}
        parts |= {key: weights[p + key] for key in ("attn_norm", "wo", "mlp_norm", "w_down")}
        state_dict |= {hf + HF_LAYER_NAMES[key]: t for key, t in parts.items()}
    return state_dict


def hf_llama(weights: Weights, cfg: ModelConfig):
    """An eval-mode `LlamaForCausalLM` whose parameters are memstep's tensors (same device and
    dtype); its rotary frequencies are built in fp32 on that device."""
    from transformers import LlamaForCausalLM

    embed = weights["embed"]
    hf_cfg = hf_config(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_cfg)
    model.load_state_dict(hf_state_dict(weights, cfg), strict=False, assign=True)
    if cfg.tie_embeddings:
        model.tie_weights()
    rotary = model.model.rotary_emb
    with torch.device(embed.device):
        model.model.rotary_emb = type(rotary)(config=hf_cfg)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise RuntimeError(f"{name} was not loaded")
    return model.eval()
