"""Per-request sampling parameters, validated at the door.

Names and defaults are vLLM's (temperature 1.0: sampled unless asked for greedy with 0), so the
same request means the same thing through `LLM`, the ZMQ client, the HTTP API and the CLI; the
one exception is `max_tokens` (64 here, 16 in vLLM; HTTP completions keep OpenAI's 16).  As in
vLLM, a served request (ZMQ, HTTP, `generate`, `chat`) first takes the model's own defaults
where it leaves a field out (`--generation-config`, core/generation_config.py).
"""

from __future__ import annotations

import json
import math
from functools import cached_property
from typing import Any

import attrs

from memstep.events.grammar_limits import limits_error

DEFAULT_TEMPERATURE = 1.0  # vLLM's and OpenAI's


class InvalidRequest(ValueError):
    """A request the engine refuses; the message says why and the engine keeps serving."""

    code = "invalid_request"


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidRequest(msg)


GUIDES = ("guided_json", "guided_json_object", "guided_regex", "guided_choice", "guided_grammar")


MAX_LOGIT_BIAS = 300  # entries in a request's logit_bias (OpenAI's limit)
LOGIT_BIAS_RANGE = 100.0  # each bias within +-100, as OpenAI's


def _bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({token id: bias}, the ids as JSON's strings or ints) or (id, bias)
    pairs, as pairs sorted by id: one form whatever the client sent, so the log records one."""
    items = bias.items() if isinstance(bias, dict) else bias
    _require(isinstance(items, (list, tuple)) or isinstance(bias, dict), "logit_bias: a map")
    pairs = []
    for item in items:
        _require(isinstance(item, (list, tuple)) and len(item) == 2, "logit_bias: id, bias pairs")
        key, value = item
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        _require(type(key) is int and key >= 0, f"logit_bias: {key!r} is not a token id")
        _require(
            type(value) in (int, float) and abs(value) <= LOGIT_BIAS_RANGE,
            f"logit_bias: the bias of {key} must be a number in [-100, 100]",
        )
        pairs.append((key, float(value)))
    return tuple(sorted(pairs))


def _schema_text(schema: Any) -> Any:
    """A JSON schema given as a map becomes its JSON text, properties in their order (what the
    log records)."""
    if isinstance(schema, dict):
        return json.dumps(schema, separators=(",", ":"))
    return schema


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
    # before this many output tokens: EOS and stop_token_ids banned, stop strings not matched
    min_tokens: int = 0
    # (token id, bias) pairs, sorted by id: each bias added to that token's logit (logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_bias_pairs)
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    include_stop_str_in_output: bool = False  # the text ends after the stop string, not before
    ignore_eos: bool = False
    logprobs: int = 0  # top-N logprobs per sampled token, 0 for none
    # vLLM's: each prompt token's logprob given the tokens before it, and its top N; None: none
    prompt_logprobs: int | None = None
    # structured outputs (vLLM's guided_* names), at most one: the text must match the constraint
    guided_json: str = attrs.field(default="", converter=_schema_text)  # a JSON schema
    guided_json_object: bool = False  # any JSON object
    guided_regex: str = ""
    guided_choice: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    guided_grammar: str = ""  # EBNF (GBNF, `::=`) or Lark

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
        _require(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs must be in [0, 20]",
        )
        _require(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens must be in [0, max_tokens]",
        )
        _require(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias: at most 300 tokens")
        _require(
            len({t for t, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias: an id twice"
        )
        _require(all(isinstance(t, int) for t in self.stop_token_ids), "stop_token_ids: ints")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop: non-empty strings")
        self._check_constraint()

    def _check_constraint(self) -> None:
        """At most one constraint, and one within the grammar engine's bounds
        (events/grammar_limits.py); whether it compiles is the engine's check at admission
        (`Engine.validate_prompt`), in a worker process."""
        given = [name for name in GUIDES if getattr(self, name)]
        _require(len(given) <= 1, f"at most one structured-output constraint, got {given}")
        _require(
            not (given and self.min_tokens),
            "min_tokens cannot go with a structured-output constraint: its grammar says where "
            "the output may end",
        )
        _require(all(isinstance(c, str) for c in self.guided_choice), "guided_choice: strings")
        if self.constraint is not None:
            error = limits_error(*self.constraint)
            _require(not error, f"{given[0]}: {error}")

    @cached_property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the structured-output constraint (core/grammar.py), or None."""
        if self.guided_json:
            return "json", self.guided_json
        if self.guided_json_object:
            return "json_object", ""
        if self.guided_regex:
            return "regex", self.guided_regex
        if self.guided_choice:
            return "choice", json.dumps(list(self.guided_choice))
        if self.guided_grammar:
            return "grammar", self.guided_grammar
        return None

    @cached_property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def has_penalties(self) -> bool:
        """Repetition, presence or frequency penalties: they read the request's history."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @cached_property
    def adjusts_logits(self) -> bool:
        """Penalties, biases or bans move this request's logits before it samples (so a greedy
        row is not simply the model's argmax)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0

    @cached_property
    def takes_argmax(self) -> bool:
        """Greedy with nothing moving the logits: the model's argmax is the token."""
        return self.is_greedy and not self.adjusts_logits

    def with_seed(self, seed: int) -> SamplingParams:
        return attrs.evolve(self, seed=seed)

    def to_dict(self) -> dict[str, Any]:
        data = attrs.asdict(self)
        data["stop_token_ids"] = list(self.stop_token_ids)
        data["stop"] = list(self.stop)
        data["guided_choice"] = list(self.guided_choice)
        data["logit_bias"] = [list(pair) for pair in self.logit_bias]
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
    if default is None:  # an optional int (the seed, prompt_logprobs)
        ok = value is None or isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(default, str):
        ok = isinstance(value, str) or key == "guided_json" and isinstance(value, dict)
    else:  # a list; OpenAI's logit_bias is a map
        ok = isinstance(value, (list, tuple)) or key == "logit_bias" and isinstance(value, dict)
    _require(ok, f"sampling param {key!r} has the wrong type ({type(value).__name__})")
