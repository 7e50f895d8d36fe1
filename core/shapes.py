"""Sizes derived from the config and the model, each rule written once."""

from __future__ import annotations

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
