"""What each backend runs for a family whose layers differ from Llama's: the CPU says once at
load that torch runs them; quantization and tensor parallelism (Llama's layers only) are
refused with a clear error (a GGUF's "auto" q4 falls back to float); every family preset runs
at tiny dimensions."""

from __future__ import annotations

import attrs
import pytest
import structlog
import torch
from tiny_families import memstep_logits

from memstep.core.config import ConfigError, EngineConfig
from memstep.core.model_config import PRESETS
from memstep.core.model_source import ModelSource
from memstep.executors.model import kv_cache
from memstep.executors.model.llama import LlamaModel
from memstep.executors.model.weights import load_weights
from memstep.executors.process.assemble import pick_backend
from memstep.executors.runtime.worker import family_quantization

CPU = torch.device("cpu")
NEW_PRESETS = ("qwen3-8b", "qwen2.5-7b", "mistral-7b", "gemma-3-12b", "phi-4-mini", "qwen3-30b-a3b")


def lacks_lines(cfg) -> list[str]:
    weights = load_weights(ModelSource("random", None, "tiny"), cfg, torch.float32, CPU)
    with structlog.testing.capture_logs() as logs:
        pick_backend(CPU, cfg, weights, torch.float32)
    return [e["event"] for e in logs if "lacks" in e["event"]]


def test_the_cpu_says_once_which_pieces_torch_runs():
    qwen3 = attrs.evolve(PRESETS["tiny"], architecture="qwen3", qk_norm=True, qkv_bias=True)
    assert lacks_lines(qwen3) == [
        "backend cpu lacks QKV bias, q/k norm for family qwen3; torch runs its layers "
        "(C decode attention kept for global layers)"
    ]
    assert lacks_lines(PRESETS["tiny"]) == []  # Llama's layers: the C kernels, nothing said


@pytest.mark.parametrize(
    ("asked", "picked", "ranks", "error"),
    [
        ("int8", "int8", 1, "int8 runs Llama's layers, not qwen3's"),
        ("none", "none", 2, "qwen3 runs on one rank: its q/k norm have no tensor-parallel"),
        ("q4", "q4", 1, "q4 runs Llama's layers, not qwen3's"),  # float matrices quantized
        ("auto", "q4", 1, None),  # a GGUF of exact types of another family: its blocks kept
    ],
)
def test_llama_only_paths_refuse_another_family(asked, picked, ranks, error):
    qwen3 = attrs.evolve(PRESETS["tiny"], architecture="qwen3", qk_norm=True)
    cfg = EngineConfig(model="random:tiny", quantization=asked)
    assert family_quantization(cfg, PRESETS["tiny"], picked, 1) == picked  # Llama: as picked
    if error is None:
        assert family_quantization(cfg, qwen3, picked, ranks) == picked
        return
    with pytest.raises(ConfigError, match=error):
        family_quantization(cfg, qwen3, picked, ranks)


@pytest.mark.parametrize("preset", NEW_PRESETS)
def test_each_family_preset_runs_at_tiny_dimensions(preset):
    """The preset's family facts over tiny sizes: random weights of every piece the family
    has, and a forward with finite logits."""
    real = PRESETS[preset]
    rotary = real.rope_dim * 16 // real.head_dim
    scaling = real.rope_scaling
    if scaling and scaling.get("rope_type") == "longrope":  # factors for the tiny rotary
        scaling = scaling | {"short_factor": (1.0,) * (rotary // 2)}
        scaling["long_factor"] = scaling["short_factor"]
    cfg = attrs.evolve(
        real,
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=512,
        head_dim=16,
        layer_windows=real.layer_windows[4:6],
        rope_scaling=scaling,
        rotary_dim=real.rotary_dim and rotary,
        num_experts=min(real.num_experts, 4),
        experts_per_token=min(real.experts_per_token, 2),
        moe_intermediate_size=min(real.moe_intermediate_size, 32),
    )
    assert cfg.unlike_llama == real.unlike_llama
    weights = load_weights(ModelSource("random", None, preset), cfg, torch.float32, CPU)
    model = LlamaModel(cfg, weights, 512, pick_backend(CPU, cfg, weights, torch.float32))
    kv = kv_cache.allocate(2, (64, 4, 2, 16), torch.float32, CPU)
    assert torch.isfinite(memstep_logits(model, kv, list(range(3, 40)))).all()
