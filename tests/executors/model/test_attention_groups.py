"""How a step's tokens are grouped for attention, and the row layout each group reads and
writes: the same results on CPU whichever way a group's rows are written back, and CUDA's
packed group (every query but the decodes in one call) against the CPU's groups."""

from __future__ import annotations

import torch

from memstep.events.plan import SeqPlan
from memstep.executors.model.attention import (
    PackedGroup,
    attention,
    build_group,
    build_packed,
    torch_group_attention,
)
from memstep.executors.runtime.batch_builder import build_batch

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8
CPU = torch.device("cpu")


def seq(name: str, start: int, n: int, pages: list[int]) -> SeqPlan:
    return SeqPlan(name, start, list(range(1, n + 1)), pages, True, 0, start + n)


def test_chunks_in_a_row_have_their_first_row():
    group = build_group([0, 6, 12], [6, 6, 6], [6, 6, 6], [[0, 1], [2, 3], [4, 5]], BLOCK, CPU)
    assert group.first_row == 0
    assert build_group([3], [6], [10], [[0, 1, 2]], BLOCK, CPU).first_row == 3


def test_padded_or_unordered_rows_have_no_first_row():
    padded = build_group([0, 6], [6, 2], [6, 2], [[0, 1], [2]], BLOCK, CPU)
    unordered = build_group([6, 0], [6, 6], [6, 6], [[0, 1], [2, 3]], BLOCK, CPU)
    for group in (padded, unordered):
        assert group.first_row == -1


def test_grouped_rows_are_written_back_like_indexed_rows():
    """A whole step (decodes, a short fresh prompt, equal fresh chunks, a continued chunk):
    attention through each group's row layout equals scattering every group by index."""
    torch.manual_seed(0)
    feeds = [
        (seq("d0", 5, 1, [0, 1]), [1]),
        (seq("s0", 0, 3, [2]), [1, 2, 3]),
        (seq("c0", 4, 9, [3, 4, 5, 6]), list(range(9))),
        (seq("c1", 0, 10, [7, 8, 9]), list(range(10))),
    ]
    batch, _ = build_batch(feeds, BLOCK, CPU)
    assert any(g.first_row >= 0 for g in batch.groups)
    cache_shape = (12, BLOCK, KV_HEADS, DIM)
    k_cache, v_cache = torch.randn(cache_shape), torch.randn(cache_shape)
    q = torch.randn(batch.num_tokens, HEADS, DIM)

    ours = attention(q, k_cache, v_cache, batch, 0.3)

    expected = torch.full_like(q, float("nan"))
    for group in batch.groups:
        res = torch_group_attention(q, k_cache, v_cache, group, 0.3).flatten(0, 1)
        expected[group.valid_rows] = res[group.valid_flat]
    assert not expected.isnan().any()
    assert torch.equal(ours, expected)


def test_decode_rows_in_order_are_attended_in_place_like_gathered_rows():
    """With a decode kernel (its plain-torch reference here, imported late: see test_kernels),
    decodes in a row are read and written in place, decodes out of order gathered and
    scattered; both equal the torch path without a kernel."""
    from memstep.executors.cuda.kernels import paged_attention_reference

    torch.manual_seed(1)
    decodes = [(seq(f"d{i}", 3 + 2 * i, 1, [2 * i, 2 * i + 1]), [1]) for i in range(3)]
    prompt = (seq("p", 0, 9, [6, 7, 8]), list(range(9)))
    cache_shape = (12, BLOCK, KV_HEADS, DIM)
    k_cache, v_cache = torch.randn(cache_shape), torch.randn(cache_shape)
    for feeds, first_row in ((decodes + [prompt], 0), ([decodes[0], prompt, *decodes[1:]], -1)):
        batch, _ = build_batch(feeds, BLOCK, CPU)
        assert batch.groups[0].is_decode and batch.groups[0].first_row == first_row
        q = torch.randn(batch.num_tokens, HEADS, DIM)

        with_kernel = attention(q, k_cache, v_cache, batch, 0.3, paged_attention_reference)

        assert torch.allclose(with_kernel, attention(q, k_cache, v_cache, batch, 0.3), atol=1e-5)


def test_decodes_kept_apart_from_other_short_queries_attend_like_one_padded_group():
    """CUDA's layout (`split_decodes`): decodes make a decode-kernel group of their own, and a
    3-token prompt tail and a 4-token verify a padded group, so that the padded group never
    gathers the decodes' KV. Through a decode kernel (the plain-torch reference) the step
    equals the single padded group that the CPU runs."""
    from memstep.executors.cuda.kernels import paged_attention_reference

    torch.manual_seed(2)
    feeds = [
        (seq("d0", 5, 1, [0, 1]), [1]),
        (seq("s0", 6, 3, [2, 3, 4]), [1, 2, 3]),
        (seq("v0", 2, 4, [5, 6]), [1, 2, 3, 4]),
        (seq("d1", 7, 1, [7, 8]), [1]),
        (seq("c0", 0, 10, [9, 10, 11]), list(range(10))),
    ]
    apart, _ = build_batch(feeds, BLOCK, CPU, split_decodes=True)
    together, _ = build_batch(feeds, BLOCK, CPU, split_decodes=False)
    decode, short = apart.groups[0], apart.groups[1]
    assert decode.is_decode and decode.seq_lens.tolist() == [6, 8]
    assert not short.is_decode and short.seq_lens.tolist() == [9, 6]
    assert not together.groups[0].is_decode and len(together.groups[0].seq_lens) == 4
    cache_shape = (12, BLOCK, KV_HEADS, DIM)
    k_cache, v_cache = torch.randn(cache_shape), torch.randn(cache_shape)
    q = torch.randn(apart.num_tokens, HEADS, DIM)

    ours = attention(q, k_cache, v_cache, apart, 0.3, paged_attention_reference)

    assert torch.allclose(ours, attention(q, k_cache, v_cache, together, 0.3), atol=1e-5)


def test_a_packed_group_lists_each_sequences_queries_and_context_slots():
    """A 3-token verify at the end of a 7-token context (pages 5, 2) and a fresh 2-token
    prompt (page 9): rows, query and key offsets, and the keys' cache slots in order."""
    group = build_packed([4, 7], [3, 2], [7, 2], [[5, 2], [9]], BLOCK, CPU)
    assert group.rows.tolist() == [4, 5, 6, 7, 8] and group.first_row == 4
    assert group.cu_q.tolist() == [0, 3, 5] and group.cu_k.tolist() == [0, 7, 9]
    assert group.kv_slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 36, 37]
    assert build_packed([7, 0], [2, 3], [2, 3], [[9], [1]], BLOCK, CPU).first_row == -1


def test_the_packed_layout_attends_every_query_as_the_cpu_groups_do():
    """CUDA's layout (decodes apart, every other query packed: verifies, prompt tails, fresh
    and continued chunks, in and out of row order) through the packed group's plain-torch
    path equals the CPU's per-chunk and padded groups."""
    torch.manual_seed(3)
    feeds = [
        (seq("d0", 5, 1, [0, 1]), [1]),
        (seq("v0", 2, 4, [2, 3]), [1, 2, 3, 4]),
        (seq("c0", 4, 9, [4, 5, 6, 7]), list(range(9))),
        (seq("d1", 7, 1, [8, 9]), [1]),
        (seq("f0", 0, 10, [10, 11, 12]), list(range(10))),
    ]
    cache_shape = (13, BLOCK, KV_HEADS, DIM)
    k_cache, v_cache = torch.randn(cache_shape), torch.randn(cache_shape)
    packed, _ = build_batch(feeds, BLOCK, CPU, packed=True)
    cpu, _ = build_batch(feeds, BLOCK, CPU)
    assert [type(g) for g in packed.groups] == [type(packed.groups[0]), PackedGroup]
    assert packed.groups[0].is_decode and packed.groups[1].first_row == -1
    q = torch.randn(packed.num_tokens, HEADS, DIM)

    ours = attention(q, k_cache, v_cache, packed, 0.3)

    assert torch.allclose(ours, attention(q, k_cache, v_cache, cpu, 0.3), atol=1e-6)


def test_packed_calls_gather_at_most_the_key_budget_or_one_context(monkeypatch):
    """Packed sequences are cut into calls of at most PACKED_KEYS context keys; a longer
    context makes a call of its own."""
    from memstep.executors.runtime import batch_builder

    monkeypatch.setattr(batch_builder, "PACKED_KEYS", 20)
    feeds = [
        (seq(f"v{i}", ctx - 2, 2, list(range(i * 8, i * 8 + 8))), [1, 2])
        for i, ctx in enumerate([10, 10, 30, 5, 6])
    ]
    batch, _ = build_batch(feeds, BLOCK, CPU, packed=True)
    assert [g.k_lens for g in batch.groups] == [(10, 10), (30,), (5, 6)]
    assert [g.first_row for g in batch.groups] == [0, 4, 6]
