"""Shapes of a Llama-family model, read from a GGUF file, a Hugging Face folder or a preset."""

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
    rope_scaling: dict[str, Any] | None = None  # Llama-3 style: factor, low/high_freq_factor, ...

    @cached_property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attn + mlp + norms) + embed + self.hidden_size

    def truncated(self, num_layers: int) -> ModelConfig:
        return attrs.evolve(self, num_layers=min(num_layers, self.num_layers))


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
