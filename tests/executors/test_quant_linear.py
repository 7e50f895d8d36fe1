"""Weight-only quantized linears: the GGUF's Q4_1 codes kept exactly, products within a bound of
the float reference, a planted wrong scale caught at load, and the precision picked at start."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from memstep.core.config import ConfigError, EngineConfig
from memstep.executors import quant_linear as ql
from memstep.executors.cpu_features import has_native_bf16
from memstep.executors.worker import pick_dtype, pick_quantization

CPU = torch.device("cpu")


def random_matrix(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    return (
        w + torch.randn(n, k // ql.GROUP, 1, generator=gen).repeat(1, 1, ql.GROUP).flatten(1) * 0.1
    )


def q4_1_bytes(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Rows of GGUF Q4_1 blocks written the way llama.cpp writes them."""
    n, k = codes.shape
    blocks = np.zeros((n, k // 32, 20), dtype=np.uint8)
    blocks[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    blocks[..., 2:4] = m.astype(np.float16)[..., None].view(np.uint8)
    groups = codes.reshape(n, k // 32, 32).astype(np.uint8)
    blocks[..., 4:] = groups[..., :16] | (groups[..., 16:] << 4)
    return blocks.reshape(n, -1)


def test_q4_1_blocks_give_back_their_codes_and_gguf_s_exact_values():
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (8, 128))
    d = rng.uniform(0.001, 0.02, (8, 4)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.2, 0.0, (8, 4)).astype(np.float16).astype(np.float32)
    data = q4_1_bytes(codes, d, m)
    got_codes, got_d, got_m = ql.q4_1_codes(data)
    assert np.array_equal(got_codes.numpy(), codes)
    assert np.array_equal(got_d.numpy(), d) and np.array_equal(got_m.numpy(), m)
    want = quants.dequantize(data, GGMLQuantizationType.Q4_1)
    assert torch.equal(ql.dequantize_q4(got_codes, got_d, got_m), torch.from_numpy(want))


@pytest.mark.parametrize("mode", ["q4", "int8"])
@pytest.mark.parametrize("rows", [1, 16, 128])
def test_quantized_product_is_within_bound_of_the_float_one(mode, rows):
    w = random_matrix(96, 256, seed=rows)
    if mode == "q4":
        codes, d, m = ql.quantize_q4(w)
        reference = ql.dequantize_q4(codes, d, m)
        made = ql.pack_q4("w", codes, d, m)
    else:
        made = ql.quantize_int8("w", w)
        reference = made["w.int8"].float() * made["w.int8_scales"].float()[:, None]
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    got = ql.make_linear(made, "w")(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    scale = x.abs() @ reference.abs().t()
    assert ((got - x @ reference.t()).abs() / scale).max() < 2**-7
    # and the quantized weights stay near the float ones they were made from
    assert (reference - w).abs().max() < (w.abs().max() / (7 if mode == "q4" else 127))


@pytest.mark.parametrize("mode", ["q4", "int8"])
def test_a_planted_wrong_scale_is_caught(mode):
    w = random_matrix(64, 192, seed=3)
    if mode == "q4":
        codes, d, m = ql.quantize_q4(w)
        made, w = ql.pack_q4("w", codes, d, m), ql.dequantize_q4(codes, d, m)
    else:
        made = ql.quantize_int8("w", w)
        w = made["w.int8"].float() * made["w.int8_scales"].float()[:, None]
    sums = ql.float_probe_sums(w)
    if mode == "q4":
        assert torch.allclose(sums[:2], ql.q4_probe_sums(codes, d, m)[:2], rtol=1e-5, atol=1e-5)
    ql.verify("w", ql.make_linear(made, "w"), sums)  # the honest one passes
    scales = made[f"w.{'int4' if mode == 'q4' else 'int8'}_scales"]
    if mode == "q4":
        scales[2, 5, 0] *= 2  # one group's scale: group 2 of row 5
    else:
        scales[5] *= 1.05  # one row's scale, 5% off
    with pytest.raises(ql.QuantizationError, match="w: quantized matrix is off"):
        ql.verify("w", ql.make_linear(made, "w"), sums)


def test_quantize_weights_replaces_every_matrix_and_keeps_the_embedding():
    from memstep.core.model_config import PRESETS
    from memstep.executors.sharding import Shard
    from memstep.executors.weights import _random

    cfg = PRESETS["tiny"]
    weights = _random(cfg, 0, torch.float32, CPU, Shard(cfg))
    out = ql.quantize_weights(weights, "q4", cfg.num_layers)
    for name in ql.layer_matrices(cfg.num_layers):
        assert name not in out and name + ".int4" in out
    assert "lm_head.int8" in out and torch.equal(out["embed"], weights["embed"])


def test_the_precision_is_picked_from_the_model_the_device_and_the_cpu():
    cfg = EngineConfig()
    assert pick_quantization(cfg, "gguf", CPU) == "none"  # until q4 meets the quality bar
    assert pick_quantization(cfg.replace(quantization="q4"), "gguf", CPU) == "q4"
    assert pick_quantization(cfg, "hf", CPU) == "none"
    assert pick_quantization(cfg.replace(quantization="none"), "gguf", CPU) == "none"
    with pytest.raises(ConfigError, match="CPU only"):
        pick_quantization(cfg.replace(quantization="int8"), "gguf", torch.device("cuda"))
    assert has_native_bf16(frozenset({"avx2", "avx512_bf16"}))
    assert has_native_bf16(frozenset({"amx_bf16"}))
    assert not has_native_bf16(frozenset({"avx2", "avx512f", "avx512bw"}))
    assert pick_dtype(cfg, CPU) == torch.float32
    assert pick_dtype(cfg.replace(dtype="float32"), CPU) == torch.float32


def test_a_bad_quantization_is_a_config_error():
    with pytest.raises(ConfigError, match="quantization must be one of"):
        EngineConfig(quantization="q3")
    assert EngineConfig.from_dict({"model": "smollm2"}).quantization == "none"  # an older log


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
