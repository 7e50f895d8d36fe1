"""Every bad input gets a clear error, not a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest

from memstep.core.config import ConfigError, EngineConfig
from memstep.core.model_source import ModelError, resolve
from memstep.core.sampling_params import InvalidRequest, SamplingParams
from memstep.executors.process.inprocess import local_engine


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memstep.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_missing_model_file_is_a_clear_cli_error(tmp_path):
    res = run_cli("generate", "--prompt", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert res.returncode == 2
    assert "model not found" in res.stderr and "Traceback" not in res.stderr


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelError, match="cannot read GGUF"):
        local_engine(EngineConfig(model=str(bad)))
    res = run_cli("generate", "--prompt", "hi", "--model", str(bad))
    assert res.returncode == 2 and "cannot read GGUF" in res.stderr


def test_unsupported_architecture_gguf(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="unsupported GGUF architecture 'gpt2'"):
        local_engine(EngineConfig(model=str(path)))


def test_unsupported_architecture_hf_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelError, match="unsupported architecture"):
        local_engine(EngineConfig(model=str(tmp_path)))


def test_folder_without_config_and_unknown_preset(tmp_path):
    with pytest.raises(ModelError, match="without config.json"):
        resolve(str(tmp_path))
    with pytest.raises(ModelError, match="unknown random preset"):
        resolve("random:nonsense")


def test_prompt_longer_than_context(smol_engine):
    too_long = [5] * smol_engine.max_model_len
    with pytest.raises(InvalidRequest, match="context"):
        smol_engine.add_request(too_long)
    with pytest.raises(InvalidRequest, match="exceeds the context"):
        smol_engine.add_request(
            [5] * 10, SamplingParams(temperature=0.0, max_tokens=smol_engine.max_model_len)
        )
    res = run_cli(
        "generate", "--model", "random:tiny", "--max-model-len", "16", "--prompt", "x" * 40
    )
    assert res.returncode == 2 and "context" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize(
    "ids, message",
    [
        ([], "empty"),
        ([49152], "outside the vocabulary"),  # the vocabulary's size: one past its last id
        ([-1], "outside the vocabulary"),
        ([5, 7, 49152, 9], "token id 49152 is outside"),  # named among good ids
        ([5, 2.0], "token id 2.0 is outside"),  # not an int
    ],
)
def test_bad_token_ids(smol_engine, ids, message):
    with pytest.raises(InvalidRequest, match=message):
        smol_engine.add_request(ids)
    assert not smol_engine.has_work()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_tokens", 0, "max_tokens"),
        ("temperature", -0.1, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -1, "top_k"),
        ("min_p", 2.0, "min_p"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("repetition_penalty", float("inf"), "repetition_penalty must be a finite number"),
        ("temperature", float("inf"), "temperature must be a finite number"),
        ("frequency_penalty", float("nan"), "frequency_penalty must be a finite number"),
        ("max_tokens", "ten", "wrong type"),
        ("bogus", 1, "unknown sampling params"),
        ("min_tokens", 65, "min_tokens must be in"),
        ("min_tokens", -1, "min_tokens must be in"),
        ("logit_bias", {"abc": 1}, "not a token id"),
        ("logit_bias", {"-3": 1}, "not a token id"),
        ("logit_bias", {"5": 101}, "must be a number in"),
        ("logit_bias", {"5": float("nan")}, "must be a number in"),
        ("logit_bias", {"5": True}, "must be a number in"),
        ("logit_bias", [[5, 1.0], [5, 2.0]], "an id twice"),
        ("logit_bias", {str(i): 1 for i in range(301)}, "at most 300"),
        ("logit_bias", "5", "wrong type"),
        ("logit_bias", [5], "id, bias pairs"),
    ],
)
def test_bad_sampling_params(field, value, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams.from_dict({field: value})


def test_min_tokens_cannot_go_with_a_grammar_that_ends_the_output():
    with pytest.raises(InvalidRequest, match="min_tokens cannot go with"):
        SamplingParams(guided_choice=("yes", "no"), min_tokens=3)


def test_bad_config():
    with pytest.raises(ConfigError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ConfigError, match="speculative_method"):
        EngineConfig(speculative_method="magic")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


def test_engine_keeps_serving_after_bad_requests(smol_engine, chat_prompts):
    for bad in ([], [10**9]):
        with pytest.raises(InvalidRequest):
            smol_engine.add_request(bad)
    (done,) = smol_engine.generate([chat_prompts[0]], SamplingParams(temperature=0.0, max_tokens=8))
    assert "Paris" in done.text


def test_logit_bias_and_stop_ids_outside_the_vocabulary_are_refused(smol_engine):
    vocab = smol_engine.model_cfg.vocab_size
    for params in (
        SamplingParams(logit_bias={str(vocab): 5.0}),
        SamplingParams(stop_token_ids=(vocab + 3,)),
        SamplingParams(stop_token_ids=(-1,), min_tokens=2),
    ):
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            smol_engine.add_request([1, 2, 3], params)
    assert not smol_engine.has_work()
