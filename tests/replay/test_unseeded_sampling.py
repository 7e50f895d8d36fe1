"""Requests without a seed draw one from the engine's generator, and the log records it.

Eight identical chat prompts at temperature 1.0 give different texts; the log of that run replays
identically, and a log whose recorded seed was changed replays with a divergence; an explicit
seed still repeats itself.  The real SmolLM2, in-process, with the engine-wide seed left to OS
entropy (the default).
"""

from __future__ import annotations

import json

import attrs
import pytest
from replay_helpers import isolate_heap, memstep
from test_edits import rewrite

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import RequestAdded
from memstep.executors.process.inprocess import local_engine
from memstep.replay.compare import replayable_bytes
from memstep.replay.recorder import open_recorder
from memstep.replay.recording import load
from memstep.replay.replayer import replay

QUESTION = "Write a haiku about the sea."
NUM_PROMPTS = 8
UNSEEDED = SamplingParams(max_tokens=16, temperature=1.0)
SEEDED = SamplingParams(max_tokens=16, temperature=1.0, seed=5)


def chat_prompt(engine: Engine) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))


@attrs.frozen
class UnseededRun:
    path: object
    unseeded: list[str]
    seeded: list[str]


@pytest.fixture(scope="module")
def unseeded_run(tmp_path_factory) -> UnseededRun:
    """Eight unseeded identical prompts, then eight with seed 5, recorded; no engine seed set."""
    path = tmp_path_factory.mktemp("unseeded") / "run.memlog"
    isolate_heap()
    recorder = open_recorder(path)
    assert recorder is not None
    engine = local_engine(EngineConfig(model="smollm2", num_threads=1), sinks=[recorder])
    try:
        prompts = [chat_prompt(engine)] * NUM_PROMPTS
        unseeded = [c.text for c in engine.generate(prompts, UNSEEDED)]
        seeded = [c.text for c in engine.generate(prompts, SEEDED)]
    finally:
        engine.shutdown()
        recorder.close()
    return UnseededRun(path, unseeded, seeded)


def test_identical_unseeded_prompts_give_different_texts(unseeded_run):
    assert len(set(unseeded_run.unseeded)) >= 6, unseeded_run.unseeded


def test_an_explicit_seed_gives_identical_texts(unseeded_run):
    assert len(set(unseeded_run.seeded)) == 1 and unseeded_run.seeded[0]


def test_the_log_records_the_drawn_seeds_and_the_engine_seed(unseeded_run):
    rec = load(unseeded_run.path)
    engine_seed = rec.config["seed"]
    assert isinstance(engine_seed, int) and 0 <= engine_seed < 2**63
    seeds = [r.params.seed for r in rec.records if isinstance(r, RequestAdded)]
    drawn, given = seeds[:NUM_PROMPTS], seeds[NUM_PROMPTS:]
    assert all(isinstance(s, int) for s in drawn) and len(set(drawn)) == NUM_PROMPTS
    assert given == [5] * NUM_PROMPTS


def test_the_log_replays_identically(unseeded_run):
    rec = load(unseeded_run.path)
    isolate_heap()
    run = replay(rec)
    assert replayable_bytes(run.derived) == replayable_bytes(rec.derived)
    assert run.config.seed == rec.config["seed"] and not run.skipped


def test_a_changed_recorded_seed_is_reported_as_a_divergence(unseeded_run, tmp_path):
    """What replay would see had the drawn seed not been recorded: another seed in its place."""
    rec = load(unseeded_run.path)
    index, added = next((i, r) for i, r in enumerate(rec.records) if isinstance(r, RequestAdded))
    params = attrs.evolve(added.params, seed=(added.params.seed + 1) % 2**63)
    edited = tmp_path / "edited.memlog"
    rewrite(unseeded_run.path, edited, index, attrs.evolve(added, params=params))
    code, out, _ = memstep("replay", str(edited), "--json")
    assert code == 1
    first = json.loads(out)["comparison"]["first"]
    assert first["event"] == "StepFinished" and first["field"].startswith("sampled")
    assert first["request_id"] == added.request_id
