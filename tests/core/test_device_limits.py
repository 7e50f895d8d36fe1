"""Batch limits chosen from the device when the user gives none: vLLM's per-GPU tiers, cut for
a model whose KV cache would not fit, the CPU's small defaults, and the user's flags first."""

from __future__ import annotations

import os
import stat

import pytest

from memstep.cli import main as cli_main
from memstep.core.device_limits import GIB, cuda_device_bytes, default_limits
from memstep.core.model_config import PRESETS

H200 = 143771 << 20


def test_the_cpu_keeps_the_small_defaults():
    limits = default_limits(None, PRESETS["llama-3.1-8b"])
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (16, 512)


@pytest.mark.parametrize(
    ("device_bytes", "preset", "expected"),
    [
        (H200, "llama-3.1-8b", (1024, 8192)),
        (80 * GIB, "llama-3.1-8b", (1024, 8192)),
        (48 * GIB, "llama-3.1-8b", (256, 2048)),
        (24 * GIB, "llama-3.1-8b", (128, 2048)),  # 5 GiB of KV after the weights: ~150 seqs
        (16 * GIB, "llama-3.1-8b", (16, 2048)),  # the weights alone fill it: the floor
        (24 * GIB, "smollm2-135m", (256, 2048)),
    ],
)
def test_cuda_limits_follow_the_device_and_the_model(device_bytes, preset, expected):
    limits = default_limits(device_bytes, PRESETS[preset])
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == expected
    assert limits.why.startswith("cuda ")


def _fake_smi(tmp_path, monkeypatch, mib: str) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{mib}'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_device_memory_is_read_from_nvidia_smi(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, "143771")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda_device_bytes("auto") == H200
    assert cuda_device_bytes("cpu") is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cuda_device_bytes("auto") is None
    _fake_smi(tmp_path, monkeypatch, "No devices were found")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cuda_device_bytes("cuda") is None


def test_the_command_line_writes_the_chosen_limits_into_the_config(tmp_path, monkeypatch):
    parser = cli_main.build_parser("serve")
    model = ["serve", "--model", "random:llama-3.1-8b"]
    assert _limits(cli_main.config_from_args(parser.parse_args(model))) == (16, 512)  # no GPU
    _fake_smi(tmp_path, monkeypatch, "143771")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _limits(cli_main.config_from_args(parser.parse_args(model))) == (1024, 8192)
    given = parser.parse_args([*model, "--max-num-seqs", "64"])
    assert _limits(cli_main.config_from_args(given)) == (64, 8192)
    few_tokens = parser.parse_args([*model, "--max-num-batched-tokens", "512"])
    assert _limits(cli_main.config_from_args(few_tokens)) == (512, 512)
    on_cpu = parser.parse_args([*model, "--device", "cpu"])
    assert _limits(cli_main.config_from_args(on_cpu)) == (16, 512)


def _limits(cfg) -> tuple[int, int]:
    return cfg.max_num_seqs, cfg.max_num_batched_tokens
