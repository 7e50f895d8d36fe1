"""A GGUF matrix's blocks in the C kernels' forms (formats/gguf_blocks.py) against the `gguf`
package's dequantizer: each weight the kernels compute is gguf's float32 value bit for bit, and
their products are float32 products of those values; a block packed wrongly fails the same
check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from memstep.executors.cpu import kernels as cpu_kernels
from memstep.executors.model.formats import gguf_blocks, kquant_writer

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")

MM = {
    "q4_1": cpu_kernels.q4_1_mm,
    "q5_0": cpu_kernels.q5_0_mm,
    "q8_0": cpu_kernels.q8_0_mm,
    "q8_16": cpu_kernels.q8_16_mm,
}
# each type's bytes the test fills at random after quantizing (every pattern is a valid block):
# the codes, and the 6- or 8-bit sub-block scales (the fp16 ones stay the quantizer's)
RANDOM_BYTES = {
    T.Q4_K: (4, 144),
    T.Q5_K: (4, 176),
    T.Q6_K: (0, 208),
    T.Q4_0: (2, 18),
    T.Q5_0: (2, 22),
    T.Q5_1: (4, 24),
    T.Q8_0: (2, 34),
}
# |kernel - float64 product of gguf's values| at most this share of sum |x| |w| (float32 sums of
# 512 products; a wrong weight in a row moves its output by far more)
PRODUCT_TOLERANCE = 2**-17


# types no writer here quantizes: their blocks made of random bytes but these fp16 scales
# (offsets in bytes), set to finite values of a row's magnitude
RANDOM_BLOCKS = {T.Q2_K: (84, (80, 82)), T.Q3_K: (110, (108,))}


def gguf_matrix(qtype: T, rows: int = 8, columns: int = 512) -> np.ndarray:
    """[rows, bytes a row] of `qtype`'s blocks: a normal matrix (rows of scales 1e-3 to 1e2)
    quantized, then its codes and sub-block scales replaced by random bytes."""
    gen = np.random.default_rng(int(qtype))
    if qtype in RANDOM_BLOCKS:
        size, halves = RANDOM_BLOCKS[qtype]
        per_row = columns // 256
        data = gen.integers(0, 256, (rows, per_row, size), dtype=np.uint8)
        magnitude = np.logspace(-3, 2, rows)[:, None, None] / 16
        for at in halves:
            scale = (gen.uniform(0.5, 1.5, (rows, per_row, 1)) * magnitude).astype(np.float16)
            data[..., at : at + 2] = scale.view(np.uint8)
        return data.reshape(rows, -1)
    x = gen.standard_normal((rows, columns)) * np.logspace(-3, 2, rows)[:, None]
    x = x.astype(np.float32)
    if qtype.name in kquant_writer.BLOCK_BYTES:
        data = kquant_writer.quantize(x, qtype.name)
    else:
        data = quants.quantize(x, qtype)
    blocks = data.reshape(-1, data.shape[1] // (columns // quants.GGML_QUANT_SIZES[qtype][0]))
    lo, hi = RANDOM_BYTES.get(qtype, (4, 4))
    blocks[:, lo:hi] = gen.integers(0, 256, (blocks.shape[0], hi - lo), dtype=np.uint8)
    return data


def assert_exact(data: np.ndarray, qtype: T, form: str) -> None:
    """The kernels' weights of `data` converted to `form` (read back through the matmul with
    one-hot rows) are gguf's values bit for bit, and a product is within PRODUCT_TOLERANCE."""
    blocks = gguf_blocks.block_rows(data, qtype, form)
    values = torch.from_numpy(np.array(quants.dequantize(data, qtype), dtype=np.float32))
    n, k = values.shape
    mm = MM[form]
    assert torch.equal(mm(torch.eye(k), blocks).t(), values)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
    exact = x.double() @ values.double().t()
    bound = x.abs().double() @ values.abs().double().t()
    assert ((mm(x, blocks).double() - exact).abs() <= PRODUCT_TOLERANCE * bound).all()


@pytest.mark.parametrize(
    "qtype", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q5_0, T.Q6_K, T.Q8_0, T.Q4_1, T.Q4_0, T.Q5_1]
)
def test_each_type_s_own_form_holds_gguf_s_values(qtype):
    assert_exact(gguf_matrix(qtype), qtype, gguf_blocks.form_of(qtype))


@pytest.mark.parametrize(
    ("qtype", "form"),
    [
        (T.Q4_K, "q8_16"),
        (T.Q5_0, "q8_16"),
        (T.Q8_0, "q8_16"),
        (T.Q4_1, "q8_16"),
        (T.Q5_0, "q8_0"),
        (T.Q4_0, "q8_16"),
    ],
)
def test_the_larger_forms_hold_a_type_for_a_fused_matrix_of_mixed_parts(qtype, form):
    assert_exact(gguf_matrix(qtype), qtype, form)


def test_a_fused_matrix_s_form():
    assert gguf_blocks.common_form([T.Q5_0, T.Q5_0]) == "q5_0"
    assert gguf_blocks.common_form([T.Q5_0, T.Q8_0, T.Q5_0]) == "q8_0"
    assert gguf_blocks.common_form([T.Q4_K, T.Q4_K]) == "q4_1"
    assert gguf_blocks.common_form([T.Q4_K, T.Q6_K]) == "q8_16"
    assert gguf_blocks.common_form([T.Q4_K, T.Q5_K]) == "q8_16"
    assert gguf_blocks.common_form([T.Q4_0, T.Q8_0]) == "q8_0"
    assert gguf_blocks.common_form([T.Q4_K, T.Q3_K]) == "q8_16"
    assert gguf_blocks.common_form([T.Q4_K, T.IQ4_NL]) is None  # IQ4_NL is dequantized
    with pytest.raises(ValueError, match="IQ4_NL blocks have no form"):
        gguf_blocks.unpack(np.zeros((2, 36), np.uint8), T.IQ4_NL)


def _swapped_nibbles(qs):  # ggml's order taken for interleaved codes
    return np.stack([qs & 0x0F, qs >> 4], axis=-1).reshape(*qs.shape[:-1], 32)


def _q4_1_interleaved(g):
    codes = g.codes.view(np.uint8)
    nibbles = codes[..., 0::2] | codes[..., 1::2] << 4
    dm = np.stack([g.scales[..., 0], g.offsets[..., 0]], axis=-1)
    return np.concatenate([dm.view(np.uint8), nibbles], axis=-1)


def _q5_0_fifth_bits_reversed(g):
    packed = PLANTS["original_q5_0"](g)
    bits = np.ascontiguousarray(packed[..., 8:12]).view("<u4")
    reversed_bits = np.zeros_like(bits)
    for j in range(32):
        reversed_bits |= ((bits >> j) & 1) << (31 - j)
    packed[..., 8:12] = reversed_bits.view(np.uint8)
    return packed


def _q4_k_min_added(b):
    codes, scales, offsets = PLANTS["original_q4_k"](b)
    return codes, scales, -offsets


def _q5_k_fifth_bits_reversed(b):  # sub-block s reading bit 7 - s of qh
    codes, scales, offsets = PLANTS["original_q5_k"](b)
    qh = b[:, 16:48].reshape(-1, 1, 32)
    wrong = (qh >> np.arange(7, -1, -1, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return (codes & 0x0F) | wrong << 4, scales, offsets


def _q3_k_high_bits_set(b):  # the hmask bit read as "subtract 4", not as "keep"
    codes, scales, offsets = PLANTS["original_q3_k"](b)
    return np.where(codes >= 0, codes - 4, codes + 4), scales, offsets


def _q8_16_halves_swapped(g):
    return PLANTS["original_pack"](
        gguf_blocks.Groups(g.codes, g.scales[..., ::-1], g.offsets[..., ::-1])
    )


PLANTS = {
    "original_q4_k": gguf_blocks._q4_k,
    "original_pack": gguf_blocks._pack_q8_16,
    "original_q5_0": gguf_blocks._pack_q5_0,
    "original_q5_k": gguf_blocks._q5_k,
    "original_q3_k": gguf_blocks._q3_k,
}


@pytest.mark.parametrize(
    ("qtype", "form", "where", "name", "wrong"),
    [
        (T.Q5_0, "q8_0", gguf_blocks, "_nibbles", _swapped_nibbles),
        (T.Q5_0, "q5_0", gguf_blocks._PACK, "q5_0", _q5_0_fifth_bits_reversed),
        (T.Q4_K, "q4_1", gguf_blocks._PACK, "q4_1", _q4_1_interleaved),
        (T.Q4_K, "q4_1", gguf_blocks._UNPACK, T.Q4_K, _q4_k_min_added),
        (T.Q6_K, "q8_16", gguf_blocks._PACK, "q8_16", _q8_16_halves_swapped),
        (T.Q5_K, "q8_16", gguf_blocks._UNPACK, T.Q5_K, _q5_k_fifth_bits_reversed),
        (T.Q3_K, "q8_16", gguf_blocks._UNPACK, T.Q3_K, _q3_k_high_bits_set),
    ],
)
def test_a_block_packed_wrongly_is_caught(monkeypatch, qtype, form, where, name, wrong):
    if isinstance(where, dict):
        monkeypatch.setitem(where, name, wrong)
    else:
        monkeypatch.setattr(where, name, wrong)
    with pytest.raises(AssertionError):
        assert_exact(gguf_matrix(qtype), qtype, form)


@pytest.mark.parametrize(("qtype", "form"), [(T.Q6_K, "q8_16"), (T.Q5_0, "q5_0")])
def test_bf16_products_are_float32_sums_of_rounded_rows_and_weights(qtype, form):
    # matmul_precision "bfloat16" on the new forms: x's rows and gguf's weights rounded to
    # bfloat16, each product exact, the sums float32, as the others' (test_cpu_kernels.py)
    data = gguf_matrix(qtype)
    blocks = gguf_blocks.block_rows(data, qtype, form)
    values = torch.from_numpy(np.array(quants.dequantize(data, qtype), dtype=np.float32))
    x = torch.randn(19, values.shape[1], generator=torch.Generator().manual_seed(1))
    rounded = x.bfloat16().double() @ values.bfloat16().double().t()
    got = MM[form](x, blocks, bf16=True)
    scale = x.abs().double() @ values.abs().double().t()
    assert ((got.double() - rounded).abs() <= PRODUCT_TOLERANCE * scale).all()
    assert ((got.double() - x.double() @ values.double().t()).abs() / scale).max() > 2**-14
