"""The next step's grammar masks begun between steps (`Sampler.mask_ahead`, on by default on a
GPU), here turned on for the CPU sampler: the same tokens as masks made at the step, most rows
taken from the work done ahead, and a mask made ahead for stale tokens is never taken (broken on
purpose: taken, it changes the tokens)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.executors.process.inprocess import local_engine
from memstep.executors.runtime.guide import Guide

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "tags", "age"],
    "additionalProperties": False,
}
PROMPTS = ["A person as JSON:", "Someone as JSON:", "A friend, as JSON:", "Plain text here:"]
PARAMS = [
    SamplingParams(
        max_tokens=40, temperature=1.0, seed=i, guided_json=json.dumps(SCHEMA) if i < 3 else ""
    )
    for i in range(4)
]


def _run(ahead: bool) -> tuple[list[list[int]], int]:
    engine = local_engine(EngineConfig(model="smollm2", num_threads=1))
    sampler = engine.executor.worker.sampler  # type: ignore[attr-defined]
    sampler.masks_ahead = ahead
    try:
        done = engine.generate(PROMPTS, PARAMS)
        return [list(c.token_ids) for c in done], sampler.num_ahead_used
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def at_the_step() -> list[list[int]]:
    tokens, used = _run(False)
    assert used == 0
    return tokens


def test_masks_made_ahead_give_the_tokens_of_masks_made_at_the_step(at_the_step):
    tokens, used = _run(True)
    assert tokens == at_the_step
    # every constrained row after a request's first came from the work done ahead
    assert used == sum(len(t) - 1 for t in tokens[:3]) > 0


def test_texts_validate_with_masks_made_ahead():
    engine = local_engine(EngineConfig(model="smollm2", num_threads=1))
    engine.executor.worker.sampler.masks_ahead = True  # type: ignore[attr-defined]
    try:
        done = engine.generate(PROMPTS[:3], PARAMS[:3])
    finally:
        engine.shutdown()
    finished = [c for c in done if c.finish_reason == "stop"]  # a text cut at its length is not
    assert len(finished) >= 2, [c.finish_reason for c in done]  # JSON: none would check nothing
    for c in finished:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_a_stale_mask_taken_changes_the_tokens(at_the_step, monkeypatch):
    """Broken on purpose: a mask made ahead is taken whatever tokens it was made for, and the
    work ahead is made one token behind (as if a step's token were missed)."""
    from memstep.executors.runtime import sampler as sampler_module

    real = sampler_module.masks_ahead

    def behind(pending, words, threads):
        real([(g, out[:-1]) for g, out in pending], words, threads)

    def take_any(self: Guide, output: list[int]):
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            self.sync(output)
        return None if ahead is None else ahead[1]

    monkeypatch.setattr(sampler_module, "masks_ahead", behind)
    monkeypatch.setattr(Guide, "take_ahead", take_any)
    tokens, used = _run(True)
    assert used > 0 and tokens != at_the_step


def test_a_mask_made_for_other_tokens_is_not_taken(at_the_step, monkeypatch):
    """The work ahead made one token behind: `take_ahead` sees it was made for other tokens,
    every row is masked at its step, and the tokens stay those of masks made at the step."""
    from memstep.executors.runtime import sampler as sampler_module

    real = sampler_module.masks_ahead
    monkeypatch.setattr(
        sampler_module, "masks_ahead", lambda p, w, t: real([(g, o[:-1]) for g, o in p], w, t)
    )
    tokens, used = _run(True)
    assert used == 0 and tokens == at_the_step
