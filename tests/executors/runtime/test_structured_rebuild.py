"""A constrained request's matcher is derived from its tokens: executor losses (in-process,
planted) re-admit constrained requests that finish exactly as without the losses, the log
replays identically, and a rebuild broken on purpose (the matcher not fed the tokens it is
re-admitted with) changes the tokens. Speculative decoding (ngram) with a schema gives plain
decoding's tokens, greedy."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import ExecutorLost, StepFinished
from memstep.executors.process.inprocess import local_engine
from memstep.executors.runtime.running_requests import RunningRequests
from memstep.replay.compare import compare
from memstep.replay.recording import Recording
from memstep.replay.replayer import replay

SMOL = EngineConfig(model="smollm2", num_threads=1)
KILLS = (6,)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "age"],
    "additionalProperties": False,
}
DATE = r"\d{4}-\d{2}-\d{2}"
PROMPTS: list[str | list[int]] = ["A person as JSON:", "Someone as JSON:", "A date:", "Yes or no?"]
PARAMS = [
    SamplingParams(max_tokens=32, temperature=0.9, seed=i, guided_json=SCHEMA) for i in range(2)
] + [
    SamplingParams(max_tokens=12, temperature=0.0, guided_regex=DATE),
    SamplingParams(max_tokens=6, temperature=0.9, seed=7, guided_choice=["yes", "no"]),
]


def _recording(records: list) -> Recording:
    started = records[0]
    header = {"config": started.config, "model_identity": started.model_identity}
    return Recording(Path("in-memory"), header, records, [])


def _run(cfg: EngineConfig, prompts=PROMPTS, params=PARAMS) -> tuple[list, list]:
    records: list = []
    engine = local_engine(cfg, [records.append])
    try:
        return engine.generate(prompts, params), records
    finally:
        engine.shutdown()


def _check_constraints(done: list) -> None:
    for c in done[:2]:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert re.fullmatch(DATE, done[2].text) and done[3].text in ("yes", "no")


@pytest.fixture(scope="module")
def clean():
    done, _ = _run(SMOL)
    _check_constraints(done)
    return done


def test_executor_losses_mid_constrained_requests_change_no_token_and_replay(clean):
    done, records = _run(SMOL.replace(debug_kill_executor_at=KILLS))
    assert [r.step for r in records if isinstance(r, ExecutorLost)] == list(KILLS)
    assert [c.token_ids for c in done] == [c.token_ids for c in clean]
    _check_constraints(done)
    recording = _recording(records)
    assert compare(recording.derived, replay(recording).derived).is_identical


def test_a_broken_rebuild_of_the_matcher_changes_the_tokens(clean, monkeypatch):
    update = RunningRequests.update

    def broken(self, seq, admission=None):  # re-admitted: the matcher believes it consumed
        state = update(self, seq, admission)  # the output tokens
        if admission is not None and state.guide is not None and len(state.tokens) > seq.prompt_len:
            state.guide.fed = list(state.tokens[seq.prompt_len :])
        return state

    monkeypatch.setattr(RunningRequests, "update", broken)
    done, _ = _run(SMOL.replace(debug_kill_executor_at=KILLS))
    assert [c.token_ids for c in done] != [c.token_ids for c in clean]


def test_ngram_speculation_with_a_schema_gives_plain_decodings_tokens():
    copy = 'Copy {"name":"Bob","tags":["a","b"],"age":30} and {"name":"Al","tags":[],"age":5}:'
    prompts: list[str | list[int]] = [copy, "A person as JSON:"]
    params = [SamplingParams(max_tokens=32, temperature=0.0, guided_json=SCHEMA)] * 2
    plain, _ = _run(SMOL, prompts, params)
    spec_cfg = SMOL.replace(speculative_method="ngram", num_speculative_tokens=3)
    spec, records = _run(spec_cfg, prompts, params)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    steps = [r for r in records if isinstance(r, StepFinished)]
    assert sum(r.num_proposed for r in steps) > 0 and sum(r.num_accepted for r in steps) > 0
    for c in spec:
        jsonschema.validate(json.loads(c.text), SCHEMA)
