"""Per-request sampling parameters, validated at the door.

Names and defaults are vLLM's (temperature 1.0: sampled unless asked for greedy with 0), so the
same request means the same thing through `LLM`, the ZMQ client, the HTTP API and the CLI; the
one exception is `max_tokens` (64 here, 16 in vLLM; HTTP completions keep OpenAI's 16).
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any

import attrs

DEFAULT_TEMPERATURE = 1.0  # vLLM's and OpenAI's


class InvalidRequest(ValueError):
    """A request the engine refuses; the message says why and the engine keeps serving."""

    code = "invalid_request"


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidRequest(msg)


@attrs.frozen(kw_only=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = DEFAULT_TEMPERATURE  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: the engine draws one from its own generator and records it
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    ignore_eos: bool = False
    logprobs: int = 0  # top-N logprobs per sampled token, 0 for none

    def __attrs_post_init__(self) -> None:
        floats = (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        )
        bad = [name for name in floats if not math.isfinite(getattr(self, name))]
        _require(not bad, f"{', '.join(bad)} must be a finite number")
        _require(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be >= 1"
        )
        _require(self.temperature >= 0.0, "temperature must be >= 0")
        _require(self.top_k >= 0, "top_k must be >= 0")
        _require(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        _require(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]")
        _require(self.repetition_penalty > 0.0, "repetition_penalty must be > 0")
        _require(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]")
        _require(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]")
        _require(self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2**63)")
        _require(0 <= self.logprobs <= 20, "logprobs must be in [0, 20]")
        _require(all(isinstance(t, int) for t in self.stop_token_ids), "stop_token_ids: ints")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop: non-empty strings")

    @cached_property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def with_seed(self, seed: int) -> SamplingParams:
        return attrs.evolve(self, seed=seed)

    def to_dict(self) -> dict[str, Any]:
        data = attrs.asdict(self)
        data["stop_token_ids"] = list(self.stop_token_ids)
        data["stop"] = list(self.stop)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        _require(isinstance(data, dict), "sampling params must be a map")
        fields = {f.name: f for f in attrs.fields(cls)}
        unknown = set(data) - set(fields)
        _require(not unknown, f"unknown sampling params: {sorted(unknown)}")
        for key, value in data.items():
            _check_type(key, value, fields[key].default)
        try:
            return cls(**data)
        except TypeError as exc:
            raise InvalidRequest(str(exc)) from exc


def _check_type(key: str, value: Any, default: Any) -> None:
    if default is None:  # an optional int (the seed)
        ok = value is None or isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (list, tuple))
    _require(ok, f"sampling param {key!r} has the wrong type ({type(value).__name__})")
