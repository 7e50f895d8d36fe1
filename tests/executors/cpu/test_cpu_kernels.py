"""The CPU's compiled kernels on the shipped GGUF's own blocks: gguf's values exactly, float32
products or bfloat16 ones, a row's result whatever else is in the batch, and paged decode
attention equal to torch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memstep.core.model_source import read_gguf, shipped_gguf_path
from memstep.executors.cpu import kernels as cpu_kernels
from memstep.executors.cpu.features import cpu_flags
from memstep.executors.model import quant_linear as ql
from memstep.executors.model.attention import build_group, torch_group_attention

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")


@pytest.fixture(scope="module")
def gguf_tensors():
    return {t.name: t for t in read_gguf(shipped_gguf_path()).tensors}


def blocks_and_values(tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from gguf import quants

    values = np.array(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    rows = ql.q4_1_rows if tensor.tensor_type.name == "Q4_1" else ql.block_rows
    return rows(tensor.data), torch.from_numpy(values)


def test_q4_1_dequant_is_gguf_s_arithmetic_bit_for_bit(gguf_tensors):
    blocks, values = blocks_and_values(gguf_tensors["blk.0.ffn_down.weight"])
    assert torch.equal(cpu_kernels.q4_1_dequant(blocks), values)


@pytest.mark.parametrize("name", ["blk.3.ffn_up.weight", "token_embd.weight"])
@pytest.mark.parametrize("rows", [1, 5, 16, 19])
def test_products_are_float32_products_of_gguf_s_values(gguf_tensors, name, rows):
    tensor = gguf_tensors[name]
    blocks, values = blocks_and_values(tensor)
    if name == "token_embd.weight":
        blocks, values = blocks[:4096], values[:4096]  # enough rows of the 49152
    mm = cpu_kernels.q4_1_mm if tensor.tensor_type.name == "Q4_1" else cpu_kernels.q8_0_mm
    x = torch.randn(rows, values.shape[1], generator=torch.Generator().manual_seed(rows))
    exact = x.double() @ values.double().t()
    got = mm(x, blocks)
    scale = x.abs().double() @ values.abs().double().t()
    assert ((got.double() - exact).abs() / scale).max() < 2**-20


def test_a_row_s_product_does_not_depend_on_the_batch(gguf_tensors):
    # every batch size through two full passes of rows (AVX-512's 16, AVX2's 12) and every tail
    blocks, values = blocks_and_values(gguf_tensors["blk.1.attn_q.weight"])
    x = torch.randn(33, values.shape[1], generator=torch.Generator().manual_seed(0))
    alone = torch.cat([cpu_kernels.q4_1_mm(x[i : i + 1], blocks) for i in range(33)])
    for m in range(2, 34):
        assert torch.equal(cpu_kernels.q4_1_mm(x[:m], blocks), alone[:m]), m


@pytest.mark.parametrize("name", ["blk.3.ffn_up.weight", "token_embd.weight"])
@pytest.mark.parametrize("rows", [1, 16, 19, 200])
def test_bf16_products_are_float32_sums_of_rounded_rows_and_weights(gguf_tensors, name, rows):
    """matmul_precision "bfloat16": x's rows and gguf's weights rounded to bfloat16 as torch
    rounds them, each product exact, the sums float32 (native AVX512-BF16 or one product at a
    time), for any number of rows (prefills included)."""
    tensor = gguf_tensors[name]
    blocks, values = blocks_and_values(tensor)
    if name == "token_embd.weight":
        blocks, values = blocks[:1024], values[:1024]
    mm = cpu_kernels.q4_1_mm if tensor.tensor_type.name == "Q4_1" else cpu_kernels.q8_0_mm
    x = torch.randn(rows, values.shape[1], generator=torch.Generator().manual_seed(rows))
    assert torch.equal(cpu_kernels.to_bf16(x), x.bfloat16())
    rounded = x.bfloat16().double() @ values.bfloat16().double().t()
    got = mm(x, blocks, bf16=True)
    scale = x.abs().double() @ values.abs().double().t()
    assert ((got.double() - rounded).abs() / scale).max() < 2**-20
    # and not the float32 products: rounding the inputs moves the outputs ~2^-9 of their scale
    assert ((got.double() - x.double() @ values.double().t()).abs() / scale).max() > 2**-14


def test_a_row_s_bf16_product_does_not_depend_on_the_batch(gguf_tensors):
    blocks, _ = blocks_and_values(gguf_tensors["blk.1.attn_q.weight"])
    x = torch.randn(
        150,
        blocks.shape[1] // cpu_kernels.Q4_1_BLOCK * 32,
        generator=torch.Generator().manual_seed(1),
    )
    alone = torch.cat([cpu_kernels.q4_1_mm(x[i : i + 1], blocks, bf16=True) for i in range(150)])
    for m in [*range(2, 34), 129, 150]:  # two full passes, every tail, and past a row block
        assert torch.equal(cpu_kernels.q4_1_mm(x[:m], blocks, bf16=True), alone[:m]), m


def test_silu_mul_is_float32_s_and_a_row_s_bits_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(7, 2 * 1544, generator=gen) * 6  # 1544: a row's last 8 one by one
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])
    got = cpu_kernels.silu_mul(gate_up)
    gate, up = gate_up.double().chunk(2, -1)
    want = gate * torch.sigmoid(gate) * up
    assert ((got.double() - want).abs() / (want.abs() + 1e-30)).max() < 2**-18  # a few ulp
    alone = torch.cat([cpu_kernels.silu_mul(gate_up[i : i + 1]) for i in range(7)])
    assert torch.equal(got, alone)


def test_the_kernels_are_built_for_the_cpu_s_vector_units():
    """AVX-512 where the CPU has it, else AVX2 + FMA: the plain-C build is ~10x slower (a SmolLM2
    q4 decode step took 159 ms instead of 12 on a 2-core AVX2 machine before AVX2 had its own)."""
    flags = cpu_flags()
    want = 512 if "avx512f" in flags else 256 if {"avx2", "fma"} <= flags else 0
    assert cpu_kernels.vector_bits() == want
    assert cpu_kernels.native_bf16() == ("avx512_bf16" in flags)


def test_decode_attention_equals_torch_s_on_pages_in_any_order():
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    k_cache = torch.randn(40, block_size, kv_heads, dim, generator=gen) * 3
    v_cache = torch.randn(40, block_size, kv_heads, dim, generator=gen)
    tables = [[3, 7, 9], [5], [10 + i for i in range(9)][::-1], [0]]
    lens = [37, 1, 130, 1]
    q = torch.randn(4, heads + kv_heads, dim, generator=gen)[:, :heads]  # strided rows, as qkv's
    group = build_group([0, 1, 2, 3], [1] * 4, lens, tables, block_size, torch.device("cpu"))
    want = torch_group_attention(q, k_cache, v_cache, group, 0.125)[:, 0]
    got = cpu_kernels.decode_attention(
        q, k_cache, v_cache, group.block_tables, group.seq_lens, 0.125
    )
    assert (got - want).abs().max() < 1e-5
    out = torch.full((4, heads, dim), float("nan"))
    empty = torch.tensor([37, 1, 130, 0], dtype=torch.int32)
    cpu_kernels.decode_attention(q, k_cache, v_cache, group.block_tables, empty, 0.125, out)
    assert torch.equal(out[:3], got[:3]) and torch.equal(out[3], torch.zeros(heads, dim))


def test_a_kernel_on_the_calling_thread_alone_gives_the_pool_s_bits(gguf_tensors):
    """Small work runs without the pool when its threads sleep (the passive policy): the
    products and the attention are the same to the bit either way."""
    blocks, values = blocks_and_values(gguf_tensors["blk.2.ffn_down.weight"])
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, values.shape[1], generator=gen)
    k_cache, v_cache = (torch.randn(8, 16, 3, 64, generator=gen) for _ in range(2))
    q = torch.randn(2, 9, 64, generator=gen)
    tables, lens = torch.tensor([[1, 4], [7, 0]], dtype=torch.int32), torch.tensor([20, 31])
    outs = []
    try:
        for work in (0, 2**62):  # every kernel on the pool, then none
            cpu_kernels.set_parallel_min(work)
            attn = cpu_kernels.decode_attention(q, k_cache, v_cache, tables, lens.int(), 0.125)
            outs.append((cpu_kernels.q4_1_mm(x, blocks), attn))
    finally:
        cpu_kernels.set_parallel_min(cpu_kernels.parallel_min())
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_rope_and_kv_write_are_apply_rope_s_bit_for_bit():
    from memstep.core.model_config import PRESETS
    from memstep.executors.model.kv_cache import write_kv
    from memstep.executors.model.layers.rotary import rope_inv_freq
    from memstep.executors.model.torch_backend import apply_rope

    cfg = PRESETS["tiny"]
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=gen)
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), rope_inv_freq(cfg))
    positions, slots = torch.tensor([0, 1, 2, 40, 63]), torch.tensor([3, 4, 5, -1, 17])
    caches = [torch.zeros(4, 8, kv_heads, dim) for _ in range(4)]
    got = cpu_kernels.rope_and_write_kv(
        qkv.clone(), freqs.cos(), freqs.sin(), positions, slots, *caches[:2], heads
    )
    cos = torch.cat([freqs.cos(), freqs.cos()], -1)[positions].unsqueeze(1)
    sin = torch.cat([-freqs.sin(), freqs.sin()], -1)[positions].unsqueeze(1)
    qk = apply_rope(qkv[:, : (heads + kv_heads) * dim].reshape(5, -1, dim), cos, sin)
    v = qkv[:, (heads + kv_heads) * dim :].reshape(5, kv_heads, dim)
    kept = slots >= 0  # torch's write has no "skip" slot
    write_kv(*caches[2:], qk[kept, heads:], v[kept], slots[kept])
    assert torch.equal(got, qk[:, :heads])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_bf16_products_without_avx512_bf16_are_the_same_sums(gguf_tensors, tmp_path):
    """The kernels built for an AVX2 CPU (no AVX512-BF16: each product one at a time, in the
    dot product's order) give the rounded rows' and weights' float32 sums too; on a CPU with
    AVX512-BF16 the native build does (test_bf16_products_are_...)."""
    import ctypes
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("needs a C compiler and an AVX2 CPU")
    flags = [f for f in cpu_kernels.CFLAGS if f != "-march=native"] + ["-march=x86-64-v3"]
    subprocess.run(
        [compiler, *flags, str(cpu_kernels.SOURCE), "-o", str(tmp_path / "k.so")],
        check=True,
        capture_output=True,
        timeout=300,
    )
    lib = ctypes.CDLL(str(tmp_path / "k.so"))
    assert lib.native_bf16() == 0
    blocks, values = blocks_and_values(gguf_tensors["blk.3.ffn_up.weight"])
    x = torch.randn(5, values.shape[1], generator=torch.Generator().manual_seed(5))
    xb, y = x.bfloat16(), torch.empty(5, values.shape[0])
    i64 = ctypes.c_int64
    lib.q4_1_mm_bf16(
        ctypes.c_void_p(xb.data_ptr()),
        ctypes.c_void_p(blocks.data_ptr()),
        ctypes.c_void_p(y.data_ptr()),
        i64(5),
        i64(values.shape[0]),
        i64(values.shape[1]),
    )
    rounded = x.bfloat16().double() @ values.bfloat16().double().t()
    scale = x.abs().double() @ values.abs().double().t()
    assert ((y.double() - rounded).abs() / scale).max() < 2**-20
