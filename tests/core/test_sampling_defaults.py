"""One default per sampling parameter, vLLM's, whichever way a request comes in."""

from __future__ import annotations

import warnings

import pytest

from memstep import SamplingParams as LLMSamplingParams
from memstep.api.openai_protocol import parse_chat, parse_completion
from memstep.api.server import _sampling_params
from memstep.cli.generate import sampling_params
from memstep.cli.main import build_parser
from memstep.core.config import ConfigError, EngineConfig, with_vllm_names
from memstep.core.sampling_params import SamplingParams

VLLM_TEMPERATURE = 1.0


def _cli(command: str, *flags: str) -> SamplingParams:
    args = build_parser(command).parse_args([command, *flags])
    return sampling_params(args)


def test_every_entry_point_defaults_to_vllms_temperature():
    temperatures = {
        "engine": SamplingParams().temperature,
        "LLM": LLMSamplingParams().temperature,
        "zmq": _sampling_params({}).temperature,  # what the server makes of a bare request
        "http completions": SamplingParams.from_dict(
            parse_completion({"prompt": "x"}, "m").params[0]
        ).temperature,
        "http chat": SamplingParams.from_dict(
            parse_chat({"messages": [{"role": "user", "content": "x"}]}, "m").params[0]
        ).temperature,
        "cli generate": _cli("generate", "--prompt", "x").temperature,
        "cli chat": _cli("chat").temperature,
    }
    assert temperatures == dict.fromkeys(temperatures, VLLM_TEMPERATURE)


def test_greedy_is_asked_for_explicitly():
    assert _cli("generate", "--prompt", "x", "--greedy").is_greedy
    assert _cli("chat", "--temperature", "0").is_greedy
    assert not _cli("chat").is_greedy


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
