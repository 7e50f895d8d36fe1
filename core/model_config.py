"""A decoder model's shapes and its family's facts, read from a GGUF file, a Hugging Face folder
or a preset.

The family facts (`architecture` and the fields after `rope_scaling`) say how a layer differs from
Llama's; their defaults are Llama's, so a Llama config sets none of them. Which facts each
architecture sets, and from which config.json or GGUF keys, is `core/model_families.py`'s.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class ModelConfig:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_context: int = 2048
    tie_embeddings: bool = True
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    rope_scaling: dict[str, Any] | None = None  # llama3, linear or longrope (`rope_type`)
    architecture: str = "llama"  # the family (`core/model_families.py`'s registry key)
    qkv_bias: bool = False  # q, k and v projections carry a bias
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before rotary
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + w): Gemma's (1 + w)
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # the embeddings are multiplied by it (Gemma: sqrt(hidden))
    sandwich_norms: bool = False  # a norm after attention and after the MLP too (Gemma 3)
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window, 0 global; () all global
    local_rope_theta: float | None = None  # windowed layers' own rotary base (Gemma 3)
    query_scale: float | None = None  # attention's scale where it is not head_dim ** -0.5
    rotary_dim: int | None = None  # rotary on the first rotary_dim of each head (partial)
    num_experts: int = 0  # mixture of experts: routed experts a layer (0: a dense MLP)
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the chosen experts' weights renormalised to sum to 1

    @cached_property
    def attn_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    @cached_property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @cached_property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens (it sees itself and the window - 1 before
        it), 0 where it attends the whole context."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @cached_property
    def unlike_llama(self) -> tuple[str, ...]:
        """What this model's layers have that a Llama layer has not (empty for Llama): the
        pieces a backend's fused Llama kernels cannot run."""
        facts = {
            "QKV bias": self.qkv_bias,
            "q/k norm": self.qk_norm,
            "(1 + w) norm": self.norm_offset != 0.0,
            "GeGLU": self.activation != "silu",
            "embedding scale": self.embed_scale != 1.0,
            "sandwich norms": self.sandwich_norms,
            "sliding window": any(self.layer_windows),
            "local rotary base": self.local_rope_theta is not None,
            "attention scale": self.query_scale is not None,
            "partial rotary": self.rope_dim != self.head_dim,
            "rotary scaling": (self.rope_scaling or {}).get("rope_type") not in (None, "llama3"),
            "experts": self.is_moe,
        }
        return tuple(name for name, has in facts.items() if has)

    @cached_property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        if self.is_moe:
            mlp = 3 * self.hidden_size * self.moe_intermediate_size * self.num_experts
            mlp += self.hidden_size * self.num_experts
        norms = 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attn + mlp + norms) + embed + self.hidden_size

    def truncated(self, num_layers: int) -> ModelConfig:
        kept = min(num_layers, self.num_layers)
        return attrs.evolve(self, num_layers=kept, layer_windows=self.layer_windows[:kept])


_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=512,
        head_dim=16,
        max_context=512,
    ),
    "smollm2-135m": ModelConfig(
        num_layers=30,
        hidden_size=576,
        intermediate_size=1536,
        num_heads=9,
        num_kv_heads=3,
        vocab_size=49152,
        head_dim=64,
        rope_theta=100000.0,
        max_context=8192,
    ),
    "llama-3.2-1b": ModelConfig(
        num_layers=16,
        hidden_size=2048,
        intermediate_size=8192,
        num_heads=32,
        num_kv_heads=8,
        vocab_size=128256,
        head_dim=64,
        rope_theta=500000.0,
        max_context=131072,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
        rope_scaling=_LLAMA3_SCALING,
    ),
    "llama-3.1-8b": ModelConfig(
        num_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        num_heads=32,
        num_kv_heads=8,
        vocab_size=128256,
        head_dim=128,
        rope_theta=500000.0,
        max_context=131072,
        tie_embeddings=False,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
        rope_scaling=_LLAMA3_SCALING,
    ),
}
# Llama-3.1-70B: the 8B's vocabulary, rotary and KV heads, wider and deeper
PRESETS["llama-3.1-70b"] = attrs.evolve(
    PRESETS["llama-3.1-8b"], num_layers=80, hidden_size=8192, intermediate_size=28672, num_heads=64
)


# the families' common sizes, with their real vocabularies (random weights: benchmarks on a GPU)
_QWEN = ModelConfig(
    num_layers=36,
    hidden_size=4096,
    intermediate_size=12288,
    num_heads=32,
    num_kv_heads=8,
    vocab_size=151936,
    head_dim=128,
    max_context=40960,
    rope_theta=1000000.0,
    rms_eps=1e-6,
    tie_embeddings=False,
    bos_token_id=None,
    eos_token_ids=(151645, 151643),
)
PRESETS["qwen3-8b"] = attrs.evolve(_QWEN, architecture="qwen3", qk_norm=True)
PRESETS["qwen2.5-7b"] = attrs.evolve(
    _QWEN,
    num_layers=28,
    hidden_size=3584,
    intermediate_size=18944,
    num_heads=28,
    num_kv_heads=4,
    vocab_size=152064,
    max_context=32768,
    architecture="qwen2",
    qkv_bias=True,
)
PRESETS["qwen3-30b-a3b"] = attrs.evolve(
    _QWEN,
    num_layers=48,
    hidden_size=2048,
    intermediate_size=6144,
    num_kv_heads=4,
    architecture="qwen3_moe",
    qk_norm=True,
    num_experts=128,
    experts_per_token=8,
    moe_intermediate_size=768,
)
PRESETS["mistral-7b"] = ModelConfig(  # v0.3: no sliding window
    num_layers=32,
    hidden_size=4096,
    intermediate_size=14336,
    num_heads=32,
    num_kv_heads=8,
    vocab_size=32768,
    head_dim=128,
    rope_theta=1000000.0,
    max_context=32768,
    tie_embeddings=False,
    architecture="mistral",
)
PRESETS["gemma-3-12b"] = ModelConfig(  # every sixth layer global, the others windowed
    num_layers=48,
    hidden_size=3840,
    intermediate_size=15360,
    num_heads=16,
    num_kv_heads=8,
    vocab_size=262208,
    head_dim=256,
    rope_theta=1000000.0,
    rms_eps=1e-6,
    max_context=131072,
    bos_token_id=2,
    eos_token_ids=(1, 106),
    rope_scaling={"rope_type": "linear", "factor": 8.0},
    architecture="gemma3",
    qk_norm=True,
    norm_offset=1.0,
    activation="gelu_tanh",
    embed_scale=3840**0.5,
    sandwich_norms=True,
    local_rope_theta=10000.0,
    query_scale=256**-0.5,
    layer_windows=tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(48)),
)
PRESETS["phi-4-mini"] = ModelConfig(  # LongRoPE's factors are placeholders: weights are random
    num_layers=32,
    hidden_size=3072,
    intermediate_size=8192,
    num_heads=24,
    num_kv_heads=8,
    vocab_size=200064,
    head_dim=128,
    rotary_dim=96,
    max_context=131072,
    bos_token_id=199999,
    eos_token_ids=(200020, 199999),
    architecture="phi3",
    rope_scaling={
        "rope_type": "longrope",
        "short_factor": (1.0,) * 48,
        "long_factor": (1.0,) * 48,
        "original_max_position_embeddings": 4096,
        "max_position_embeddings": 131072,
    },
)
