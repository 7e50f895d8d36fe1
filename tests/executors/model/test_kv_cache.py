"""The KV cache's storage: fp8 writes and reads, saturation at fp8's range, page counts, and an
fp8 cache serving the real model."""

from __future__ import annotations

import torch

from memstep.cli.traffic import staggered
from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.executors.model import kv_cache
from memstep.executors.model.kv_cache import KV_FP8, gather_kv, write_kv
from memstep.executors.process.inprocess import local_engine

BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 6, 4, 2, 8


def caches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return kv_cache.allocate(1, (BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype, "cpu")


def test_fp8_cache_stores_what_float8_rounds_to_and_reads_it_back():
    generator = torch.Generator().manual_seed(0)
    k = torch.randn(5, KV_HEADS, HEAD_DIM, generator=generator) * 3
    v = torch.randn(5, KV_HEADS, HEAD_DIM, generator=generator)
    slots = torch.tensor([0, 1, 6, 13, 23])  # pages 0, 0, 1, 3, 5
    [(k_cache, v_cache)] = caches(KV_FP8)

    write_kv(k_cache, v_cache, k, v, slots)

    table = torch.tensor([[0, 1, 2, 3, 4, 5]])
    k_read = gather_kv(k_cache, table, torch.float32)[0].transpose(0, 1)  # [T, KVH, D]
    v_read = gather_kv(v_cache, table, torch.float32)[0].transpose(0, 1)
    assert k_read.dtype == torch.float32
    torch.testing.assert_close(k_read[slots], k.to(KV_FP8).float(), atol=0, rtol=0)
    torch.testing.assert_close(v_read[slots], v.to(KV_FP8).float(), atol=0, rtol=0)
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value
    assert ((k_read[slots] - k).abs() <= k.abs() / 16 + 2**-10).all()
    untouched = torch.ones(BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots] = False
    assert (k_read[untouched] == 0).all() and (v_read[untouched] == 0).all()


def test_fp8_cache_saturates_values_beyond_its_range():
    values = torch.tensor([1000.0, -1e6, 448.0, 3.0])
    k = values.repeat(KV_HEADS * HEAD_DIM // 4).view(1, KV_HEADS, HEAD_DIM)
    [(k_cache, v_cache)] = caches(KV_FP8)

    write_kv(k_cache, v_cache, k, k, torch.tensor([0]))

    stored = k_cache[0, 0].float()
    assert not stored.isnan().any()
    assert stored.max() == 448.0 and stored.min() == -448.0


def test_model_dtype_cache_is_unchanged_by_the_storage_layer():
    generator = torch.Generator().manual_seed(1)
    k = torch.randn(3, KV_HEADS, HEAD_DIM, generator=generator)
    [(k_cache, v_cache)] = caches(torch.float32)

    write_kv(k_cache, v_cache, k, -k, torch.tensor([2, 5, 9]))

    assert kv_cache.kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache.kv_dtype("fp8", torch.bfloat16) == KV_FP8
    torch.testing.assert_close(k_cache.view(-1, KV_HEADS, HEAD_DIM)[[2, 5, 9]], k)
    torch.testing.assert_close(v_cache.view(-1, KV_HEADS, HEAD_DIM)[[2, 5, 9]], -k)


def test_fp8_cache_holds_four_times_the_pages_of_fp32_in_the_same_bytes():
    plans = {}
    for name in ("auto", "fp8"):
        cfg = EngineConfig(model="random:tiny", dtype="float32", kv_cache_dtype=name)
        engine = local_engine(cfg.replace(cpu_kv_cache_bytes=2**20, num_threads=1))
        plans[name] = engine.memory_plan
        engine.shutdown()
    assert plans["fp8"].kv_page_bytes * 4 == plans["auto"].kv_page_bytes
    assert plans["fp8"].num_kv_blocks == 4 * plans["auto"].num_kv_blocks


# nats, on the first generated token's top-5 log-probs (SmolLM2-135M, 8 chat prompts: 0.62)
FP8_LOGPROB_TOLERANCE = 1.0


def test_fp8_cache_serves_the_real_model_close_to_the_fp32_cache(
    smol_engine, fp8_smol_engine, chat_prompts
):
    """The first generated token's top-5 log-probs differ by a fraction of a nat, and where
    the greedy choices differ the fp8 one was a near-tie in the fp32 distribution: fp8 rounds
    K and V to 3 mantissa bits, so tokens may diverge, as in other engines."""
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=5)
    exact = smol_engine.generate(chat_prompts, params)
    fp8 = fp8_smol_engine.generate(chat_prompts, params)
    worst, same = 0.0, 0
    for a, b in zip(exact, fp8, strict=True):
        top_a, top_b = dict(map(tuple, a.logprobs[0][1])), dict(map(tuple, b.logprobs[0][1]))
        for token in top_a.keys() & top_b.keys():
            worst = max(worst, abs(top_a[token] - top_b[token]))
        same += a.token_ids[0] == b.token_ids[0]
        assert top_a[a.token_ids[0]] - top_a[b.token_ids[0]] < FP8_LOGPROB_TOLERANCE
    print(
        f"fp8 vs fp32 cache: {same}/{len(exact)} first tokens equal, top-5 log-probs within "
        f"{worst:.3f} nats"
    )
    assert 0 < worst < FP8_LOGPROB_TOLERANCE
    assert same >= len(exact) - 2


def _lengths(n: int) -> list[SamplingParams]:
    """Greedy, 6 to 27 tokens: requests end at different steps, so batch-mates change."""
    return [
        SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(n)
    ]


def _batch_and_arrivals(chat_prompts) -> tuple[list[list[int]], list[list[int]]]:
    cfg = EngineConfig(
        dtype="float32", quantization="none", kv_cache_dtype="fp8", enable_prefix_caching=False
    )
    params = _lengths(len(chat_prompts))
    batch = [c.token_ids for c in local_engine(cfg).generate(chat_prompts, params)]
    # 3 requests, 3 steps, then 5 more join: other batch-mates than all 8 at once
    return batch, staggered(local_engine(cfg), chat_prompts, params)


def test_an_fp8_cache_gives_a_sequence_its_tokens_whatever_shares_its_batch(chat_prompts):
    """The CPU attends each sequence of a padded group alone: padded beside longer ones, the
    last bits of its attention changed, and an fp8 store rounded that up to a whole step (one
    of these prompts parted between one batch of 8 and these arrivals)."""
    batch, arrived = _batch_and_arrivals(chat_prompts)
    assert batch == arrived


def test_the_batch_check_fires_when_attention_depends_on_the_group(chat_prompts, monkeypatch):
    from memstep.executors.model import attention

    plain = attention.torch_group_attention

    def by_group_size(q, k_cache, v_cache, group, scale, window=0, device_kernels=False):
        out = plain(q, k_cache, v_cache, group, scale, window, device_kernels)
        return out * (1 + 0.2 * group.token_index.shape[0])

    monkeypatch.setattr(attention, "torch_group_attention", by_group_size)
    batch, arrived = _batch_and_arrivals(chat_prompts)
    assert batch != arrived


def test_slots_for_runs_a_page_at_a_time_to_the_slots_of_each_position():
    table = [7, 2, 9, 4]
    for start in range(0, 12):
        for n in range(0, 16 - start):
            want = [kv_cache.slot_of(table, p, 4) for p in range(start, start + n)]
            assert kv_cache.slots_for(table, start, n, 4) == want, (start, n)
