"""memstep's k-quant writer against the `gguf` package's dequantizer (llama.cpp's layouts in
numpy, written apart from the writer): rows quantized and read back lie within the type's
bound, and a block packed wrongly is caught by the same check."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from memstep.executors.model.formats import kquant_writer
from memstep.executors.model.formats.kquant_writer import q4_k_m_type, quantize

# type -> (levels a code takes less one, relative RMS error on normal rows at most)
BOUND = {"Q4_K": (15, 0.09), "Q5_K": (31, 0.045), "Q6_K": (63, 0.023)}


def rows() -> np.ndarray:
    """Normal rows of scales 1e-3 to 1e3, and super-blocks of zeros, of one value, all
    negative and with one outlier."""
    gen = np.random.default_rng(0)
    x = gen.standard_normal((16, 512)) * np.logspace(-3, 3, 16)[:, None]
    x[0, :256] = 0
    x[1, :256] = 5
    x[2, :256] = -np.abs(x[2, :256])
    x[3, 7] = 1e4
    return x.astype(np.float32)


def round_trip_error(x: np.ndarray, qtype: str) -> tuple[float, float]:
    """The worst error over a super-block's step (its range over the type's levels) and the
    RMS error over the values' RMS, of normal rows, after the `gguf` package reads the blocks."""
    blocks = quantize(x, qtype)
    assert blocks.dtype == np.uint8
    assert blocks.shape == (x.shape[0], x.shape[1] // 256 * kquant_writer.BLOCK_BYTES[qtype])
    back = quants.dequantize(blocks, GGMLQuantizationType[qtype]).reshape(x.shape)
    levels = BOUND[qtype][0]
    sb, err = x.reshape(-1, 256), np.abs(back - x).reshape(-1, 256)
    if qtype == "Q6_K":  # symmetric: the range is twice the largest magnitude
        span = 2 * np.abs(sb).max(axis=1)
    else:  # the min at most zero, as llama.cpp's
        span = sb.max(axis=1) - np.minimum(sb.min(axis=1), 0)
    worst = float((err.max(axis=1) / np.maximum(span / levels, 1e-30)).max())
    normal = slice(4 * 512, None)
    rms = float(np.sqrt((err.ravel()[normal] ** 2).mean() / (x.ravel()[normal] ** 2).mean()))
    return worst, rms


@pytest.mark.parametrize("qtype", BOUND)
def test_rows_read_back_within_the_types_bound(qtype):
    worst, rms = round_trip_error(rows(), qtype)
    assert worst <= 1.0  # never more than one step of the super-block's range
    assert rms < BOUND[qtype][1]


@pytest.mark.parametrize(
    ("qtype", "plant"),
    [
        ("Q4_K", "scales_and_mins_swapped"),
        ("Q5_K", "high_scale_bits_dropped"),
        ("Q4_K", "nibbles_swapped"),
    ],
)
def test_a_block_packed_wrongly_is_caught(monkeypatch, qtype, plant):
    pack, nibbles = kquant_writer.pack_scales_mins, kquant_writer._nibbles
    planted = {
        "scales_and_mins_swapped": ("pack_scales_mins", lambda sc, m: pack(m, sc)),
        "high_scale_bits_dropped": ("pack_scales_mins", lambda sc, m: pack(sc & 0x0F, m)),
        "nibbles_swapped": ("_nibbles", lambda codes: nibbles(codes[:, ::-1])),
    }
    monkeypatch.setattr(kquant_writer, *planted[plant])
    worst, _ = round_trip_error(rows(), qtype)
    assert worst > 1.0


def test_a_q6_k_scale_of_the_wrong_sign_is_caught(monkeypatch):
    grid = kquant_writer._grid

    def negated(values, top):
        step, units = grid(values, top)
        return -step, units

    monkeypatch.setattr(kquant_writer, "_grid", negated)
    worst, _ = round_trip_error(rows(), "Q6_K")
    assert worst > 1.0


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 100), dtype=np.float32), "Q4_K")
    with pytest.raises(ValueError, match="Q3_K is not a k-quant"):
        quantize(np.zeros((2, 256), dtype=np.float32), "Q3_K")


def test_q4_k_m_gives_the_head_and_some_v_and_down_more_bits():
    assert q4_k_m_type("output.weight", 16) == "Q6_K"
    assert q4_k_m_type("token_embd.weight", 16) == "Q4_K"
    assert q4_k_m_type("token_embd.weight", 16, has_output=False) == "Q6_K"
    # 16 layers: the first and last two, and every third from the fourth
    more = [i for i in range(16) if q4_k_m_type(f"blk.{i}.attn_v.weight", 16) == "Q6_K"]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]
    assert q4_k_m_type("blk.4.ffn_down.weight", 16) == "Q6_K"
    assert q4_k_m_type("blk.4.attn_q.weight", 16) == "Q4_K"
