"""Weight-only quantized linears: blocks made here as gguf makes them, products within a bound of
the float reference (float32 rounding for q4), a planted wrong int8 scale caught at load, and the
precision picked at start."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from memstep.core.config import ConfigError, EngineConfig
from memstep.core.model_source import resolve
from memstep.executors.cpu import kernels as cpu_kernels
from memstep.executors.cpu.features import has_native_bf16
from memstep.executors.cpu.linear import cpu_linear
from memstep.executors.model import quant_linear as ql
from memstep.executors.runtime.worker import pick_dtype, pick_quantization

CPU = torch.device("cpu")


def random_matrix(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    return (
        w + torch.randn(n, k // ql.GROUP, 1, generator=gen).repeat(1, 1, ql.GROUP).flatten(1) * 0.1
    )


def as_gguf(blocks: torch.Tensor) -> np.ndarray:
    """Q4_1 rows as the kernels take them (float32 d and m) back in gguf's layout (fp16): the
    conversion raises unless each d and m is an fp16 value, as in a GGUF."""
    rows = blocks.numpy().reshape(blocks.shape[0], -1, 24)
    scales = rows[..., :8].copy().view(np.float32)
    halves = scales.astype(np.float16)
    assert np.array_equal(halves.astype(np.float32), scales), "d or m is not an fp16 value"
    return np.concatenate([halves.view(np.uint8), rows[..., 8:]], -1).reshape(len(rows), -1)


def gguf_values(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """gguf's own dequantization of rows of blocks."""
    from gguf import GGMLQuantizationType, quants

    kind_type = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}[kind]
    data = as_gguf(blocks) if kind == "q4_1" else blocks.numpy()
    return torch.from_numpy(np.array(quants.dequantize(data, kind_type)))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_blocks_made_here_are_gguf_s_and_near_the_float_matrix(kind):
    w = random_matrix(8, 128, seed=0)
    blocks = ql.quantize_q4(w) if kind == "q4_1" else ql.quantize_q8_0(w)
    assert blocks.dtype == torch.uint8 and blocks.shape == (8, 4 * (24 if kind == "q4_1" else 34))
    values = gguf_values(blocks, kind)
    steps = w.reshape(8, 4, 32).abs().amax(-1).repeat_interleave(32, 1)
    assert ((values - w).abs() <= steps / (15 if kind == "q4_1" else 127)).all()


@pytest.mark.parametrize("mode", ["q4", "int8"])
@pytest.mark.parametrize("rows", [1, 16, 128])
def test_quantized_product_is_within_bound_of_the_float_one(mode, rows):
    w = random_matrix(96, 256, seed=rows)
    if mode == "q4":
        made = {"w.q4_1": ql.quantize_q4(w)}
        reference, bound = gguf_values(made["w.q4_1"], "q4_1"), 2**-20  # float32 products
    else:
        made = ql.quantize_int8("w", w)
        reference = made["w.int8"].float() * made["w.int8_scales"].float()[:, None]
        bound = 2**-7  # bfloat16 rows
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    got = cpu_linear(made, "w", F.linear)(x)  # q4: the CPU backend's C kernels
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    scale = x.abs() @ reference.abs().t()
    assert ((got - x @ reference.t()).abs() / scale).max() < bound
    # and the quantized weights stay near the float ones they were made from
    assert (reference - w).abs().max() < (w.abs().max() / (7 if mode == "q4" else 127))


def test_a_planted_wrong_int8_scale_is_caught():
    made = ql.quantize_int8("w", random_matrix(64, 192, seed=3))
    w = made["w.int8"].float() * made["w.int8_scales"].float()[:, None]
    sums = ql.float_probe_sums(w)
    ql.verify("w", ql.make_linear(made, "w"), sums)  # the honest one passes
    made["w.int8_scales"][5] *= 1.05  # one row's scale, 5% off
    with pytest.raises(ql.QuantizationError, match="w: quantized matrix is off"):
        ql.verify("w", ql.make_linear(made, "w"), sums)


def test_quantize_weights_replaces_every_matrix_and_keeps_the_embedding():
    from memstep.core.model_config import PRESETS
    from memstep.executors.model.sharding import Shard
    from memstep.executors.model.weights import _random

    cfg = PRESETS["tiny"]
    weights = _random(cfg, 0, torch.float32, CPU, Shard(cfg))
    out = ql.quantize_weights(weights, "q4", cfg.num_layers)
    for name in ql.layer_matrices(cfg.num_layers):
        assert name not in out and name + ".q4_1" in out
    assert "lm_head.q8_0" in out and torch.equal(out["embed"], weights["embed"])


def test_the_precision_is_picked_from_the_model_the_device_and_the_cpu():
    cfg = EngineConfig()
    shipped = resolve("smollm2")
    assert pick_quantization(cfg, shipped, CPU) == "q4"  # its Q4_1 blocks, float32 products
    assert pick_quantization(cfg.replace(quantization="none"), shipped, CPU) == "none"
    assert pick_quantization(cfg, resolve("random:tiny"), CPU) == "none"
    assert pick_quantization(cfg.replace(quantization="q4"), resolve("random:tiny"), CPU) == "q4"
    with pytest.raises(ConfigError, match="CPU only"):
        pick_quantization(cfg.replace(quantization="int8"), shipped, torch.device("cuda"))
    assert pick_quantization(cfg, shipped, torch.device("cuda")) == "none"
    assert pick_quantization(cfg.replace(tensor_parallel_size=2), shipped, CPU) == "none"
    assert has_native_bf16(frozenset({"avx2", "avx512_bf16"}))
    assert has_native_bf16(frozenset({"amx_bf16"}))
    assert not has_native_bf16(frozenset({"avx2", "avx512f", "avx512bw"}))
    assert pick_dtype(cfg, CPU) == torch.float32
    assert pick_dtype(cfg.replace(dtype="float32"), CPU) == torch.float32


def test_a_bad_quantization_is_a_config_error():
    with pytest.raises(ConfigError, match="quantization must be one of"):
        EngineConfig(quantization="q3")
    assert EngineConfig.from_dict({"model": "smollm2"}).quantization == "none"  # an older log
    with pytest.raises(ConfigError, match="matmul_precision must be one of"):
        EngineConfig(matmul_precision="bf16")
    assert EngineConfig.from_dict({"model": "smollm2"}).matmul_precision == "float32"


def test_matmul_precision_auto_is_bf16_where_the_cpu_multiplies_it():
    from memstep.executors.runtime.worker import pick_matmul_precision

    cfg = EngineConfig()
    native = "bfloat16" if cpu_kernels.native_bf16() else "float32"
    assert pick_matmul_precision(cfg, "q4") == native
    assert pick_matmul_precision(cfg, "none") == "float32"  # only q4's kernels have a choice
    assert pick_matmul_precision(cfg, "int8") == "float32"
    assert pick_matmul_precision(cfg.replace(kv_cache_dtype="fp8"), "q4") == "float32"
    for asked in ("float32", "bfloat16"):
        assert pick_matmul_precision(cfg.replace(matmul_precision=asked), "q4") == asked


@pytest.mark.parametrize("value", ["q3", "Q4", ""])
def test_a_bad_quantization_flag_is_a_one_line_error(value):
    argv = ["generate", "--model", "random:tiny", "--num-threads", "1", "--prompt", "hi"]
    res = subprocess.run(
        [sys.executable, "-m", "memstep.cli.main", *argv, "--quantization", value],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("memstep: error: "), res.stderr
    assert (
        f"quantization must be one of ('auto', 'none', 'int8', 'q4'), got {value!r}" in res.stderr
    )
