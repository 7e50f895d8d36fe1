"""The architectures memstep runs and each one's facts, read from a config.json or GGUF keys.

One registry (`FAMILIES`) keyed by the family name, found from the HF `architectures` name
(`by_hf_architecture`) or the GGUF `general.architecture` (`by_gguf_architecture`). A family
states only how its config differs from Llama's: the `ModelConfig` family fields it sets, fixed
(`fixed`) or read from its config.json (`read_hf`). The layers that compute them are
`executors/model/`'s; this module is torch-free, for the engine core.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

Json = dict[str, Any]
Field = Callable[[str, Any], Any]


class UnsupportedArchitecture(ValueError):
    """The config names an architecture (or a feature of one) memstep does not run."""


@attrs.frozen
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    gguf_architecture: str
    fixed: dict[str, Any] = attrs.field(factory=dict)  # ModelConfig fields the family sets
    read_hf: Callable[[Json], Json] = lambda cfg: {}  # fields it reads from its config.json
    # fields it reads from its GGUF keys (`field(key, default)`, key without `{arch}.`); None:
    # its GGUF files are not read yet
    read_gguf: Callable[[Field], Json] | None = None


def rope_parameters(cfg: Json, layer_type: str | None = None) -> Json:
    """The rotary settings: transformers 5's `rope_parameters` (per layer type where the config
    nests them), else the top-level `rope_theta` and `rope_scaling` of older configs."""
    rope = cfg.get("rope_parameters") or {}
    if layer_type is not None and isinstance(rope.get(layer_type), dict):
        rope = rope[layer_type]
    elif "full_attention" in rope:
        rope = rope["full_attention"]
    merged = {**(cfg.get("rope_scaling") or {}), **rope}
    if "rope_theta" in cfg and "rope_theta" not in rope:
        merged["rope_theta"] = cfg["rope_theta"]
    if "type" in merged and "rope_type" not in merged:
        merged["rope_type"] = merged.pop("type")
    return merged


def windows(cfg: Json) -> tuple[int, ...]:
    """Each layer's sliding window: the config's `layer_types` where it lists them, else
    `sliding_window` on every layer where set (Mistral's rule), else none."""
    window = cfg.get("sliding_window") or 0
    layers = cfg["num_hidden_layers"]
    if not window:
        return ()
    types = cfg.get("layer_types")
    if types is None and "sliding_window_pattern" in cfg:  # transformers 4's Gemma 3 configs
        pattern = cfg["sliding_window_pattern"]
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ]
    if types is None:
        return (window,) * layers
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _qwen3(cfg: Json) -> Json:
    return {"qkv_bias": bool(cfg.get("attention_bias", False)), "layer_windows": _qwen_windows(cfg)}


def _qwen_windows(cfg: Json) -> tuple[int, ...]:
    """Qwen's window applies only with `use_sliding_window`, from `max_window_layers` on."""
    if not cfg.get("use_sliding_window") or not cfg.get("sliding_window"):
        return ()
    if cfg.get("layer_types"):
        return windows(cfg)
    first = cfg.get("max_window_layers", 0)
    return tuple(
        cfg["sliding_window"] if i >= first else 0 for i in range(cfg["num_hidden_layers"])
    )


def _gemma3(cfg: Json) -> Json:
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(cap):
            raise UnsupportedArchitecture(f"Gemma 3 with {cap}={cfg[cap]} (memstep has none)")
    nested = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    theta = nested.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0
    scalar = cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256
    return {
        "embed_scale": math.sqrt(cfg["hidden_size"]),
        "layer_windows": windows(cfg),
        "local_rope_theta": float(theta),
        "query_scale": float(scalar) ** -0.5,
    }


def _phi3(cfg: Json) -> Json:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    partial = rope_parameters(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    return {"layer_windows": windows(cfg), "rotary_dim": int(head_dim * (partial or 1.0))}


def _experts(cfg: Json, expert_width: str) -> Json:
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedArchitecture("dense layers among the expert layers (mlp_only_layers)")
    return {
        "num_experts": int(cfg.get("num_experts") or cfg["num_local_experts"]),
        "experts_per_token": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg[expert_width]),
    }


def _gguf_gemma3(field: Field) -> Json:
    """llama.cpp's Gemma 3: windowed layers from `attention.sliding_window_pattern` (a flag a
    layer, or every n-th global; five of six without it), the local base 10000, the query
    scale from the head size (the 27B's, 62 layers, from hidden / heads), and the (1 + w) of
    the norms already added into the file's norm weights."""
    layers, window = field("block_count", 0), field("attention.sliding_window", 0)
    pattern = field("attention.sliding_window_pattern", 6)
    if isinstance(pattern, int):
        pattern = [(i + 1) % pattern != 0 for i in range(layers)]
    head = field("attention.key_length", 256)
    if layers == 62:
        head = field("embedding_length", 0) // field("attention.head_count", 1)
    return {
        "norm_offset": 0.0,
        "embed_scale": math.sqrt(field("embedding_length", 0)),
        "layer_windows": tuple(window if windowed else 0 for windowed in pattern),
        "local_rope_theta": 10000.0,
        "query_scale": float(head) ** -0.5,
    }


def _gguf_experts(field: Field) -> Json:
    return {
        "num_experts": int(field("expert_count", 0)),
        "experts_per_token": int(field("expert_used_count", 0)),
        "moe_intermediate_size": int(
            field("expert_feed_forward_length", 0) or field("feed_forward_length", 0)
        ),
        "norm_topk_prob": bool(field("expert_weights_norm", True)),
    }


def _gguf_phi3(field: Field) -> Json:
    """llama.cpp's Phi-3: the rotary's dims (`rope.dimension_count`, partial of each head) and
    a window on every layer where `attention.sliding_window` is set (its LongRoPE factors are
    tensors: `model_source` reads them)."""
    layers, window = field("block_count", 0), field("attention.sliding_window", 0)
    return {
        "rotary_dim": int(field("rope.dimension_count", 0)) or None,
        "layer_windows": (int(window),) * layers if window else (),
    }


def _none(field: Field) -> Json:
    return {}


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", ("LlamaForCausalLM",), "llama", read_gguf=_none),
        Family(
            "mistral",
            ("MistralForCausalLM",),
            "mistral",
            read_hf=lambda c: {"layer_windows": windows(c)},
        ),
        Family(
            "qwen2",
            ("Qwen2ForCausalLM",),
            "qwen2",
            {"qkv_bias": True},
            read_hf=lambda c: {"layer_windows": _qwen_windows(c)},
            read_gguf=_none,
        ),
        Family(
            "qwen3",
            ("Qwen3ForCausalLM",),
            "qwen3",
            {"qk_norm": True},
            read_hf=_qwen3,
            read_gguf=_none,
        ),
        Family(
            "gemma3",
            ("Gemma3ForCausalLM",),
            "gemma3",
            {
                "norm_offset": 1.0,
                "activation": "gelu_tanh",
                "sandwich_norms": True,
                "qk_norm": True,
            },
            read_hf=_gemma3,
            read_gguf=_gguf_gemma3,
        ),
        Family("phi3", ("Phi3ForCausalLM",), "phi3", read_hf=_phi3, read_gguf=_gguf_phi3),
        Family(
            "qwen3_moe",
            ("Qwen3MoeForCausalLM",),
            "qwen3moe",
            {"qk_norm": True},
            read_hf=lambda c: (
                _qwen3(c)
                | _experts(c, "moe_intermediate_size")
                | {"norm_topk_prob": bool(c.get("norm_topk_prob", False))}
            ),
            read_gguf=_gguf_experts,
        ),
        Family(
            "mixtral",
            ("MixtralForCausalLM",),
            "mixtral",
            {"norm_topk_prob": True},
            read_hf=lambda c: _experts(c, "intermediate_size") | {"layer_windows": windows(c)},
            read_gguf=_gguf_experts,  # llama.cpp writes Mixtral as `llama` with experts
        ),
    )
}
_MODEL_TYPES = {"gemma3_text": "gemma3"}


# multimodal checkpoints whose text model memstep serves: their name -> the text model's
WRAPPERS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}


def text_part(cfg: Json) -> Json:
    """A multimodal config's text model (`text_config`, as its own config.json would read);
    any other config as it is. The vision tower is not loaded: prompts are text."""
    archs = cfg.get("architectures") or ()
    wrapped = [WRAPPERS[a] for a in archs if a in WRAPPERS]
    if not wrapped or "text_config" not in cfg:
        return cfg
    inherited = {
        k: cfg[k] for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id") if k in cfg
    }
    return inherited | cfg["text_config"] | {"architectures": wrapped}


def by_hf_architecture(cfg: Json) -> Family:
    """The family of a config.json: its `architectures`, else its `model_type`."""
    for arch in cfg.get("architectures") or ():
        for family in FAMILIES.values():
            if arch in family.hf_architectures:
                return family
    model_type = _MODEL_TYPES.get(cfg.get("model_type", ""), cfg.get("model_type"))
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    raise UnsupportedArchitecture(
        f"unsupported architecture {cfg.get('architectures') or model_type}: memstep runs "
        f"{', '.join(a for f in FAMILIES.values() for a in f.hf_architectures)}"
    )


def by_gguf_architecture(arch: str) -> Family:
    for family in FAMILIES.values():
        if family.gguf_architecture == arch:
            return family
    raise UnsupportedArchitecture(
        f"unsupported GGUF architecture {arch!r}: memstep runs "
        f"{', '.join(f.gguf_architecture for f in FAMILIES.values())}"
    )
