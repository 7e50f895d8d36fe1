"""Sizes derived from the config and the model, each rule written once."""

from __future__ import annotations

import attrs

from memstep.core.config import ConfigError, EngineConfig
from memstep.core.model_config import ModelConfig

DEFAULT_MAX_MODEL_LEN = 2048  # when the config names none: the model's context, capped here


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many `b`-sized pieces hold `a`."""
    return -(-a // b)


def max_model_len(cfg: EngineConfig, model: ModelConfig) -> int:
    """The longest sequence (prompt + output) the engine serves: the config's value, which the
    model's context bounds, or the model's context capped at `DEFAULT_MAX_MODEL_LEN`."""
    if cfg.max_model_len is None:
        return min(DEFAULT_MAX_MODEL_LEN, model.max_context)
    if cfg.max_model_len > model.max_context:
        raise ConfigError(
            f"max_model_len {cfg.max_model_len} exceeds the model's context of "
            f"{model.max_context} tokens"
        )
    return cfg.max_model_len


def max_blocks_per_seq(max_len: int, lookahead: int, block_size: int) -> int:
    """KV pages one sequence may hold: its longest context, the drafts it verifies beyond it,
    and one page of slack for a decode replayed ahead."""
    return cdiv(max_len + lookahead, block_size) + 1


def layer_activation_elements(model: ModelConfig) -> int:
    """Elements of one token's activations inside a decoder layer on CUDA, each intermediate
    counted once: four hidden-sized (residual, norms, attention and MLP outputs), q, k and v,
    and three of the MLP's width (gate and up, their product); with experts, each of the
    token's k entries' (gate and up, product, down row) and its router row in float32. The
    graphs' pools hold these."""
    m = model
    mlp = 3 * m.intermediate_size
    if m.is_moe:
        entry = 3 * m.moe_intermediate_size + m.hidden_size
        mlp = m.experts_per_token * entry + 2 * m.num_experts
    return 4 * m.hidden_size + (m.num_heads + 2 * m.num_kv_heads) * m.head_dim + mlp


def check_tensor_parallel(model: ModelConfig, size: int) -> None:
    """Tensor parallelism splits query heads, KV heads and the MLP's width evenly over `size`
    ranks (the vocabulary is padded instead); a model that does not split is a ConfigError."""
    parts = {
        "query heads": model.num_heads,
        "KV heads": model.num_kv_heads,
        "intermediate size": model.intermediate_size,
    }
    for what, n in parts.items():
        if n % size:
            raise ConfigError(
                f"tensor_parallel_size {size} does not divide the model's {n} {what}; "
                f"choose a size that divides {model.num_heads} and {model.num_kv_heads}"
            )


def vocab_shard_size(model: ModelConfig, size: int) -> int:
    """Rows of the embedding and the head each rank holds: the vocabulary padded to `size`."""
    return cdiv(model.vocab_size, size)


def rank_model_config(model: ModelConfig, size: int) -> ModelConfig:
    """One rank's share of `model` under tensor parallelism: its query and KV heads and its
    slice of the MLP; hidden size and vocabulary stay whole (activations and sampled rows)."""
    check_tensor_parallel(model, size)
    return attrs.evolve(
        model,
        num_heads=model.num_heads // size,
        num_kv_heads=model.num_kv_heads // size,
        intermediate_size=model.intermediate_size // size,
    )
