"""One default per sampling parameter, whichever way a request comes in: vLLM's bare ones, or
the model's own (`--generation-config auto`, as vLLM's) filling only what a request leaves out."""

from __future__ import annotations

import json
import warnings

import pytest

from memstep import SamplingParams as LLMSamplingParams
from memstep.cli.generate import model_defaults, sampling_params
from memstep.cli.main import build_parser, config_from_args
from memstep.core.config import ConfigError, EngineConfig, with_vllm_names
from memstep.core.generation_config import SHIPPED, sampling_defaults
from memstep.core.model_source import ModelError, ModelSource, resolve
from memstep.core.sampling_params import SamplingParams
from memstep.serving.core_admission import _sampling_params
from memstep.serving.http_front.openai_protocol import parse_chat, parse_completion

VLLM_TEMPERATURE = 1.0
BARE = ("--generation-config", "vllm")


def _cli(command: str, *flags: str) -> SamplingParams:
    args = build_parser(command).parse_args([command, *flags])
    return sampling_params(args, model_defaults(config_from_args(args, max_num_seqs=1)))


def test_every_entry_point_defaults_to_vllms_temperature():
    temperatures = {
        "engine": SamplingParams().temperature,
        "LLM": LLMSamplingParams().temperature,
        "zmq": _sampling_params({}, {}).temperature,  # what the server makes of a bare request
        "http completions": SamplingParams.from_dict(
            parse_completion({"prompt": "x"}, "m").params[0]
        ).temperature,
        "http chat": SamplingParams.from_dict(
            parse_chat({"messages": [{"role": "user", "content": "x"}]}, "m").params[0]
        ).temperature,
        "cli generate": _cli("generate", "--prompt", "x", *BARE).temperature,
        "cli chat": _cli("chat", *BARE).temperature,
    }
    assert temperatures == dict.fromkeys(temperatures, VLLM_TEMPERATURE)


def test_greedy_is_asked_for_explicitly():
    assert _cli("generate", "--prompt", "x", "--greedy").is_greedy
    assert _cli("chat", "--temperature", "0").is_greedy
    assert not _cli("chat").is_greedy


def test_the_models_defaults_fill_what_a_request_leaves_out():
    """SmolLM2's card (temperature 0.2, top-p 0.9) under `auto`, at the server and in the CLI;
    a request's own values win; `vllm` keeps the bare defaults."""
    assert (
        sampling_defaults(resolve("smollm2"), "auto")
        == SHIPPED
        == {"temperature": 0.2, "top_p": 0.9}
    )
    bare = _sampling_params({}, SHIPPED)
    assert (bare.temperature, bare.top_p) == (0.2, 0.9)
    own = _sampling_params({"temperature": 1.0, "top_p": None}, SHIPPED)
    assert (own.temperature, own.top_p) == (1.0, 0.9)  # nil: the default, as left out
    cli = _cli("generate", "--prompt", "x")
    assert (cli.temperature, cli.top_p) == (0.2, 0.9)
    assert _cli("generate", "--prompt", "x", "--top-p", "0.5").top_p == 0.5
    assert _cli("generate", "--prompt", "x", "--greedy").temperature == 0.0
    assert sampling_defaults(resolve("random:tiny"), "auto") == {}  # no model card to follow


def test_a_generation_config_json_is_read_as_vllm_reads_it(tmp_path):
    given = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    given |= {"max_new_tokens": 99, "bos_token_id": 1, "eos_token_id": [2]}
    (tmp_path / "generation_config.json").write_text(json.dumps(given))
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 99}
    assert sampling_defaults(ModelSource("hf", tmp_path), "auto") == want
    assert sampling_defaults(resolve("smollm2"), str(tmp_path)) == want  # a folder named
    assert sampling_defaults(ModelSource("hf", tmp_path), "vllm") == {}
    with pytest.raises(ModelError, match="no generation_config.json"):
        sampling_defaults(resolve("smollm2"), str(tmp_path / "elsewhere"))
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ModelError, match="not a JSON object"):
        sampling_defaults(ModelSource("hf", tmp_path), "auto")


def test_the_old_config_name_warns_and_maps_to_vllms():
    with pytest.warns(DeprecationWarning, match="memory_utilization is deprecated"):
        values = with_vllm_names({"memory_utilization": 0.7})
    assert EngineConfig(**values).gpu_memory_utilization == 0.7
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # vLLM's name: no warning
        assert with_vllm_names({"gpu_memory_utilization": 0.7}) == {"gpu_memory_utilization": 0.7}
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="not both"):
        with_vllm_names({"memory_utilization": 0.7, "gpu_memory_utilization": 0.6})


def test_a_log_written_with_the_old_name_still_loads():
    old = {**EngineConfig().to_dict(), "memory_utilization": 0.6}
    del old["gpu_memory_utilization"]
    assert EngineConfig.from_dict(old).gpu_memory_utilization == 0.6


def test_the_old_flag_warns_and_sets_the_new_one():
    parser = build_parser("serve")
    with pytest.warns(DeprecationWarning, match="use --gpu-memory-utilization"):
        args = parser.parse_args(["serve", "--memory-utilization", "0.5"])
    assert args.gpu_memory_utilization == 0.5
    assert (
        parser.parse_args(["serve"]).gpu_memory_utilization == EngineConfig().gpu_memory_utilization
    )
