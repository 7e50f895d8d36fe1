"""Triton kernels against their plain-torch references.

Without CUDA the kernels run in Triton's interpreter. Triton 3.x picks interpreter or compiler
when `@triton.jit` runs, that is when triton.language and the kernel modules are imported, so
TRITON_INTERPRET must be set before anything imports triton: this module sets it at import, and
`test_interpreter_flag_precedes_triton_import` fails if another module imported triton first.
The variable then stays set for the session on CPU-only machines, where it only makes Triton
kernels imported later runnable.
"""

import os
import sys

import pytest
import torch

_IS_INTERPRETED = not torch.cuda.is_available()
_TRITON_IMPORTED_TOO_EARLY = (
    _IS_INTERPRETED and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
)
if _IS_INTERPRETED:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from memstep.executors.cuda.kernels import (  # noqa: E402
    DecodeWorkspace,
    fused_add_rmsnorm,
    fused_add_rmsnorm_reference,
    paged_attention_reference,
    paged_decode_attention,
    rmsnorm,
    rmsnorm_reference,
    rope_and_write_kv,
    rope_and_write_kv_reference,
    silu_mul,
    silu_mul_reference,
    triton_available,
    use_split_k,
)
from memstep.executors.model.kv_cache import KV_FP8  # noqa: E402

needs_triton = pytest.mark.skipif(
    not triton_available() or _TRITON_IMPORTED_TOO_EARLY,
    reason="needs CUDA, or TRITON_INTERPRET=1 set before triton is imported",
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_interpreter_flag_precedes_triton_import():
    assert not _TRITON_IMPORTED_TOO_EARLY, (
        "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run "
        "interpreted; set the variable in the environment or in tests/conftest.py"
    )


def make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, generator=None):
    """Random K/V caches whose pages are handed out in shuffled order.

    Returns k_cache, v_cache, block_tables, seq_lens. Slots past a sequence's end and the page
    that unused table entries point at hold NaN, so any read the kernel should mask shows up.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(max(blocks_per_seq), 1)
    num_blocks = sum(blocks_per_seq) + 2  # + one spare + the poison page
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    poison_page = num_blocks - 1
    pages = torch.randperm(num_blocks - 1, generator=generator).tolist()
    block_tables = torch.full((len(seq_lens), max_blocks), poison_page, dtype=torch.int32)
    for seq, (seq_len, num_pages) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        seq_pages = [pages.pop() for _ in range(num_pages)]
        block_tables[seq, :num_pages] = torch.tensor(seq_pages, dtype=torch.int32)
        if seq_len % block_size:
            for cache in (k_cache, v_cache):
                cache[seq_pages[-1], seq_len % block_size :] = float("nan")
    for cache in (k_cache, v_cache):
        cache[poison_page] = float("nan")
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return k_cache, v_cache, block_tables.to(device), seq_lens_t.to(device)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@needs_triton
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group_size", [1, 3])
def test_paged_decode_matches_reference(group_size, block_size, split):
    generator = torch.Generator().manual_seed(group_size * 100 + block_size)
    num_kv_heads, head_dim = 2, 32
    # ragged: a single token, an exact page multiple, and 150 tokens: several 64-token tiles
    # unsplit, two 128-token partitions of two tiles each split
    seq_lens = [1, 2 * block_size, 150, 5]
    k_cache, v_cache, block_tables, seq_lens_t = make_paged_kv(
        seq_lens, block_size, num_kv_heads, head_dim, torch.float32, DEVICE, generator
    )
    q = torch.randn(len(seq_lens), num_kv_heads * group_size, head_dim, generator=generator)
    q = q.to(DEVICE)
    max_context_len = block_tables.shape[1] * block_size
    workspace = DecodeWorkspace.allocate(4, q.shape[1], head_dim, max_context_len, DEVICE, 128)
    out = torch.full_like(q, float("nan"))

    result = paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens_t, 0.17, out, workspace, split
    )

    expected = paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens_t, 0.17)
    assert result is out
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
def test_paged_decode_window_matches_the_torch_attention(split):
    """A sliding-window layer's decode rows: the kernel reads only each row's last `window`
    keys, as the engine's torch attention masks them (`attention.torch_group_attention`); with
    64-token partitions, the 150-token row's first partition lies wholly before its window.
    The same call without the window (the planted mistake) does not match."""
    from memstep.executors.model.attention import build_group, torch_group_attention

    generator = torch.Generator().manual_seed(31)
    block_size, window, seq_lens = 4, 24, [1, 24, 150, 30]
    k_cache, v_cache, tables, lens = make_paged_kv(
        seq_lens, block_size, 2, 32, torch.float32, DEVICE, generator
    )
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    q = torch.randn(len(seq_lens), 6, 32, generator=generator).to(DEVICE)
    workspace = DecodeWorkspace.allocate(4, 6, 32, tables.shape[1] * block_size, DEVICE, 64)
    rows = tables.tolist()
    group = build_group(list(range(4)), [1] * 4, seq_lens, rows, block_size, q.device)

    out = paged_decode_attention(
        q, k_cache, v_cache, tables, lens, 0.2, workspace=workspace, split=split, window=window
    )
    unwindowed = paged_decode_attention(
        q, k_cache, v_cache, tables, lens, 0.2, workspace=workspace, split=split
    )

    expected = torch_group_attention(q, k_cache, v_cache, group, 0.2, window)[:, 0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    reference = paged_attention_reference(q, k_cache, v_cache, tables, lens, 0.2, window=window)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    assert (unwindowed - expected)[2:].abs().max() > 1e-2  # rows past the window differ
    torch.testing.assert_close(unwindowed[:2], expected[:2], atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
def test_paged_decode_pads_head_dim_and_large_groups(split):
    generator = torch.Generator().manual_seed(7)
    seq_lens = [19, 3]
    k_cache, v_cache, block_tables, seq_lens_t = make_paged_kv(
        seq_lens, 8, 1, 24, torch.float32, DEVICE, generator
    )
    q = torch.randn(2, 20, 24, generator=generator).to(DEVICE)  # group of 20 > 16 rows
    workspace = DecodeWorkspace.allocate(2, 20, 24, 24, DEVICE, partition_size=16)

    out = paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens_t, 0.2, workspace=workspace, split=split
    )

    expected = paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens_t, 0.2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
def test_paged_decode_reads_an_fp8_cache(split):
    """An fp8 cache (`kv_cache_dtype="fp8"`): tiles converted to q's dtype as they load, the
    same values the reference reads; NaN in unread slots still never leaks through."""
    generator = torch.Generator().manual_seed(8)
    seq_lens = [1, 37, 150]
    k_cache, v_cache, block_tables, seq_lens_t = make_paged_kv(
        seq_lens, 16, 2, 32, KV_FP8, DEVICE, generator
    )
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    q = torch.randn(3, 6, 32, generator=generator).to(DEVICE, dtype)
    workspace = DecodeWorkspace.allocate(3, 6, 32, block_tables.shape[1] * 16, DEVICE, 128)

    out = paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens_t, 0.17, workspace=workspace, split=split
    )

    expected = paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens_t, 0.17)
    assert out.dtype == dtype and out.isfinite().all()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@needs_triton
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
def test_paged_decode_writes_zeros_for_empty_padding_slots(split):
    generator = torch.Generator().manual_seed(3)
    k_cache, v_cache, block_tables, seq_lens_t = make_paged_kv(
        [20, 0], 4, 1, 16, torch.float32, DEVICE, generator
    )
    q = torch.randn(2, 2, 16, generator=generator).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    workspace = DecodeWorkspace.allocate(2, 2, 16, 20, DEVICE, partition_size=16)

    paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens_t, 0.25, out, workspace, split
    )

    expected = paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens_t, 0.25)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_triton
def test_use_split_k_only_when_the_grid_is_too_small():
    assert use_split_k(num_seqs=1, num_kv_heads=8, max_context_len=4096, num_sms=132)
    assert not use_split_k(num_seqs=64, num_kv_heads=8, max_context_len=4096, num_sms=132)
    assert not use_split_k(num_seqs=1, num_kv_heads=8, max_context_len=256, num_sms=132)


@needs_triton
def test_workspace_too_small_is_rejected():
    k_cache, v_cache, block_tables, seq_lens_t = make_paged_kv(
        [40], 4, 1, 16, torch.float32, DEVICE
    )
    q = torch.randn(1, 1, 16, device=DEVICE)
    workspace = DecodeWorkspace.allocate(1, 1, 16, 16, DEVICE, partition_size=16)

    with pytest.raises(ValueError, match="partitions"):
        paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens_t, 1.0, workspace=workspace, split=True
        )


@needs_triton
def test_heads_not_a_multiple_of_kv_heads_are_rejected():
    k_cache, v_cache, block_tables, seq_lens_t = make_paged_kv([4], 4, 2, 16, torch.float32, DEVICE)
    q = torch.randn(1, 3, 16, device=DEVICE)

    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, 1.0)


@needs_triton
@pytest.mark.parametrize("shape", [(3, 40), (2, 3, 64)])
def test_rmsnorm_matches_reference(shape):
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=generator).to(DEVICE)
    weight = torch.randn(shape[-1], generator=generator).to(DEVICE)
    out = torch.full_like(x, float("nan"))

    result = rmsnorm(x, weight, 1e-6, out=out)

    assert result is out
    torch.testing.assert_close(out, rmsnorm_reference(x, weight, 1e-6), atol=1e-5, rtol=1e-5)


@needs_triton
def test_rmsnorm_reads_strided_rows():
    generator = torch.Generator().manual_seed(12)
    wide = torch.randn(4, 96, generator=generator).to(DEVICE)
    x = wide[:, :48]  # row stride 96
    weight = torch.randn(48, generator=generator).to(DEVICE)

    out = rmsnorm(x, weight, 1e-5)

    torch.testing.assert_close(out, rmsnorm_reference(x, weight, 1e-5), atol=1e-5, rtol=1e-5)


@needs_triton
def test_fused_add_rmsnorm_updates_residual_and_matches_reference():
    generator = torch.Generator().manual_seed(13)
    x = torch.randn(5, 80, generator=generator).to(DEVICE)
    residual = torch.randn(5, 80, generator=generator).to(DEVICE)
    weight = torch.randn(80, generator=generator).to(DEVICE)
    expected_residual = residual.clone()

    out = fused_add_rmsnorm(x, residual, weight, 1e-6)

    expected = fused_add_rmsnorm_reference(x, expected_residual, weight, 1e-6)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# Realistic sizes: Llama-3.1-8B attention (32 query heads, 8 KV heads, head_dim 128), bf16.


def make_llama_decode_batch(seq_lens, generator, block_size=16):
    batch = len(seq_lens)
    k_cache, v_cache, block_tables, seq_lens_t = make_paged_kv(
        seq_lens, block_size, 8, 128, torch.bfloat16, "cuda", generator
    )
    q = torch.randn(batch, 32, 128, generator=generator).to("cuda", torch.bfloat16)
    return q, k_cache, v_cache, block_tables, seq_lens_t


@needs_triton
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("split", [None, False, True], ids=["heuristic", "unsplit", "split"])
@pytest.mark.parametrize("max_seq_len", [128, 4096])
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
def test_paged_decode_bf16_llama_sizes(batch, max_seq_len, split):
    generator = torch.Generator().manual_seed(batch * 10_000 + max_seq_len)
    ragged_lens = torch.randint(1, max_seq_len + 1, (batch,), generator=generator).tolist()
    ragged_lens[0] = max_seq_len
    q, k_cache, v_cache, block_tables, seq_lens = make_llama_decode_batch(ragged_lens, generator)
    scale = 128**-0.5

    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, split=split)

    expected = paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale)
    assert out.isfinite().all()
    assert relative_error(out, expected) < 1e-2
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@needs_triton
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch", [7, 256])
def test_paged_decode_fp8_cache_llama_sizes(batch):
    generator = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 2049, (batch,), generator=generator).tolist()
    q, k_cache, v_cache, block_tables, seq_lens = make_llama_decode_batch(lens, generator)
    k_cache, v_cache = k_cache.to(KV_FP8), v_cache.to(KV_FP8)
    scale = 128**-0.5

    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)

    expected = paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale)
    assert out.isfinite().all()
    assert relative_error(out, expected) < 1e-2


@needs_triton
@pytest.mark.gpu
@needs_cuda
def test_paged_decode_fp8_cache_keeps_queries_past_fp16_range_finite():
    """With an fp8 cache the dots run in fp16: a bf16 query beyond fp16's range is clamped
    into it instead of turning into inf and NaN."""
    generator = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, block_tables, seq_lens = make_llama_decode_batch([40, 300], generator)
    k_cache, v_cache = k_cache.to(KV_FP8), v_cache.to(KV_FP8)
    q[0, :4] = 1e6  # the four query heads of KV head 0

    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 128**-0.5)

    assert out.isfinite().all()


@needs_triton
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
def test_paged_decode_replays_in_a_cuda_graph(split):
    generator = torch.Generator().manual_seed(5)
    max_batch, max_seq_len, scale = 8, 1024, 128**-0.5
    # full tables, so any later seq_len up to max_seq_len has real pages
    q, k_cache, v_cache, block_tables, seq_lens = make_llama_decode_batch(
        [max_seq_len] * max_batch, generator
    )
    out = torch.empty_like(q)
    workspace = DecodeWorkspace.allocate(max_batch, 32, 128, max_seq_len, "cuda")

    def decode():
        paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, out, workspace, split
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode()  # warmup: compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode()

    # new contents in the captured buffers, including a padding slot with seq_len 0
    q.copy_(torch.randn(q.shape, generator=generator).to(q))
    new_lens = torch.randint(1, max_seq_len + 1, (max_batch,), generator=generator)
    new_lens[-1] = 0
    seq_lens.copy_(new_lens.to(seq_lens))
    block_tables.copy_(block_tables.flip(0))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()

    expected = paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale)
    assert out.isfinite().all()
    assert relative_error(out, expected) < 1e-2
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@needs_triton
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_rows", [1, 256])
def test_fused_add_rmsnorm_bf16_llama_sizes(num_rows):
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 4096, generator=generator).to("cuda", torch.bfloat16)
    residual = torch.randn(num_rows, 4096, generator=generator).to("cuda", torch.bfloat16)
    weight = torch.rand(4096, generator=generator).to("cuda", torch.bfloat16)
    expected_residual = residual.clone()

    out = fused_add_rmsnorm(x, residual, weight, 1e-5)

    expected = fused_add_rmsnorm_reference(x, expected_residual, weight, 1e-5)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


# The rest of the decode step: rotary + KV write, silu * up, and the whole fused decode forward.


@needs_triton
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (9, 3)])  # 9 + 2 * 3 heads straddle programs
def test_rope_and_write_kv_matches_reference_and_skips_padding_slots(block_size, heads, kv_heads):
    generator = torch.Generator().manual_seed(21)
    head_dim, tokens, blocks = 16, 5, 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    angles = torch.randn(40, head_dim // 2, generator=generator)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 3, 17, 39, 0], dtype=torch.int32)
    slots = torch.tensor([2, 9, block_size * 3 + 1, 0, -1], dtype=torch.int32)  # last: padding
    cache_shape = (blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=generator)
    v_cache = torch.randn(cache_shape, generator=generator)
    expected = [t.clone() for t in (qkv, k_cache, v_cache)]
    qkv, k_cache, v_cache, positions, slots, cos, sin = (
        t.to(DEVICE) for t in (qkv, k_cache, v_cache, positions, slots, cos, sin)
    )
    expected = [t.to(DEVICE) for t in expected]

    q = rope_and_write_kv(qkv, cos, sin, positions, slots, k_cache, v_cache, heads)

    q_ref = rope_and_write_kv_reference(
        expected[0], cos, sin, positions, slots, expected[1], expected[2], heads
    )
    assert q.shape == (tokens, heads, head_dim) and q.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(qkv, expected[0], atol=1e-6, rtol=1e-6)  # k, v columns kept
    torch.testing.assert_close(k_cache, expected[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v_cache, expected[2], atol=0, rtol=0)


@needs_triton
def test_rope_and_write_kv_norms_q_and_k_heads_first():
    """Qwen3's and Gemma 3's q/k norms inside the rotary kernel: each q and k head RMS-normed
    with its weight, then rotated; v heads as they were. Without the norm it differs."""
    generator = torch.Generator().manual_seed(24)
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 4
    qkv = torch.randn(3, (heads + 2 * kv_heads) * head_dim, generator=generator).to(DEVICE)
    angles = torch.randn(8, head_dim // 2, generator=generator).to(DEVICE)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([1, 5, 7], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([0, 5, 9], dtype=torch.int32, device=DEVICE)
    q_norm, k_norm = (1 + 0.3 * torch.randn(2, head_dim, generator=generator)).to(DEVICE)
    caches = [torch.zeros(4, block_size, kv_heads, head_dim, device=DEVICE) for _ in range(4)]
    normed = qkv.clone()
    for lo, hi, weight in ((0, heads, q_norm), (heads, heads + kv_heads, k_norm)):
        part = normed[:, lo * head_dim : hi * head_dim].view(3, -1, head_dim)
        part.copy_(rmsnorm_reference(part, weight, 1e-6))
    plain = qkv.clone()

    q = rope_and_write_kv(
        qkv, cos, sin, positions, slots, *caches[:2], heads, (q_norm, k_norm, 1e-6)
    )

    q_ref = rope_and_write_kv_reference(normed, cos, sin, positions, slots, *caches[2:], heads)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[0], caches[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1], caches[3], atol=0, rtol=0)
    unnormed = rope_and_write_kv(plain, cos, sin, positions, slots, *caches[:2], heads)
    assert (unnormed - q_ref).abs().max() > 1e-2


@needs_triton
def test_rope_and_write_kv_into_an_fp8_cache_saturates_like_the_reference():
    """Values past fp8's range are stored as +-448; on the GPU every value equals the
    reference's (torch's rounding)."""
    generator = torch.Generator().manual_seed(23)
    heads, kv_heads, head_dim, tokens = 4, 2, 16, 4
    # large rows so that some rotated k and some v pass fp8's largest value, 448
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator) * 300
    angles = torch.randn(8, head_dim // 2, generator=generator)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 3, 5, 7], dtype=torch.int32)
    slots = torch.tensor([2, 9, 17, 30], dtype=torch.int32)
    caches = [torch.zeros(2, 16, kv_heads, head_dim, dtype=KV_FP8) for _ in range(4)]
    qkv, cos, sin, positions, slots, *caches = (
        t.to(DEVICE) for t in (qkv, cos, sin, positions, slots, *caches)
    )

    tables = (cos, sin, positions, slots)
    rope_and_write_kv(qkv.clone(), *tables, caches[0], caches[1], heads)

    rope_and_write_kv_reference(qkv.clone(), *tables, caches[2], caches[3], heads)
    for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        ours, ref = ours.float(), ref.float()
        assert not ours.isnan().any() and ours.abs().max() == 448.0 == ref.abs().max()
        if not _IS_INTERPRETED:  # the interpreter's float8 rounding is its own (127.6 -> 64)
            torch.testing.assert_close(ours, ref, atol=0, rtol=0)


@needs_triton
def test_silu_mul_matches_reference():
    generator = torch.Generator().manual_seed(22)
    gate_up = torch.randn(3, 2 * 1500, generator=generator).to(DEVICE)  # two column blocks
    out = torch.full((3, 1500), float("nan"), device=DEVICE)

    result = silu_mul(gate_up, out)

    assert result is out
    torch.testing.assert_close(out, silu_mul_reference(gate_up), atol=1e-6, rtol=1e-6)


@needs_triton
def test_fused_decode_forward_matches_the_eager_model():
    """The graph runner's decode forward (run eagerly here) against `LlamaModel.forward`:
    same hidden states, same KV written, padding rows write nothing."""
    from memstep.core.config import EngineConfig
    from memstep.events.plan import SeqPlan
    from memstep.executors.cuda.backend import CudaBackend
    from memstep.executors.cuda.graph_runner import GraphRunner
    from memstep.executors.model.llama import LlamaModel
    from memstep.executors.process.assemble import build_worker

    cfg = EngineConfig(model="random:tiny", dtype="float32", max_num_seqs=8, num_kv_blocks=40)
    worker = build_worker(cfg, max_model_len=128)
    worker.enter_phase("profile", 0)
    generator = torch.Generator().manual_seed(23)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (5, 17, 33)]
    tables = [list(range(10 * i, 10 * i + 3)) for i in range(3)]
    prefill = [
        SeqPlan(f"r{i}", 0, p, t, True, 0, len(p))
        for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
    ]
    decode = [
        SeqPlan(s.request_id, len(s.token_ids), [7 + i], s.block_table, True, 0, 0)
        for i, s in enumerate(prefill)
    ]
    # the runner's layers are CUDA's kernels (Triton's interpreter here) over the same weights
    model = worker.model
    twin = LlamaModel(model.cfg, model.w, model.cos.shape[0], CudaBackend())
    runner = GraphRunner(twin, worker.kv, 8, 128, 0, cfg.block_size)
    with torch.inference_mode():
        worker.forward([(s, s.token_ids) for s in prefill])
        kv_before = [(k.clone(), v.clone()) for k, v in worker.kv]
        expected, _ = worker.forward([(s, s.token_ids) for s in decode])
        kv_expected = [(k.clone(), v.clone()) for k, v in worker.kv]
        for (k, v), (k0, v0) in zip(worker.kv, kv_before, strict=True):
            k.copy_(k0)
            v.copy_(v0)

        hidden, rows = runner.run([(s, s.token_ids) for s in decode])

    assert runner.padded_size(3) == 4 and rows == [0, 1, 2]
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
    for (k, v), (k1, v1) in zip(worker.kv, kv_expected, strict=True):
        torch.testing.assert_close(k, k1, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v, v1, atol=1e-6, rtol=1e-6)
