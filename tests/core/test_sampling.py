"""The sampler's filters and penalties on hand-made logits, and stop conditions end to end."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from memstep.core.sampling_params import InvalidRequest, SamplingParams
from memstep.executors.runtime.random_stream import ACCEPT, DRAFT, SAMPLE, uniform, uniforms
from memstep.executors.runtime.sampler import Row, Sampler, top_logprobs

V = 8


def dist(params: SamplingParams, logits: list[float], history=(), prompt_len=0) -> torch.Tensor:
    sampler = Sampler(2, V, torch.device("cpu"))
    row = Row(params, len(history), list(history), prompt_len)
    return sampler.distribution(torch.tensor([logits]), [row])[0].clone()


LOGITS = [4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]


def test_greedy_is_one_hot_on_argmax():
    p = dist(SamplingParams(temperature=0.0), LOGITS)
    assert p.tolist() == [1.0] + [0.0] * 7


def test_top_k_keeps_k_tokens():
    p = dist(SamplingParams(temperature=1.0, top_k=3), LOGITS)
    assert (p > 0).sum() == 3 and p[:3].gt(0).all()


def test_top_p_keeps_smallest_prefix_reaching_p():
    full = torch.softmax(torch.tensor(LOGITS), -1)
    p = dist(SamplingParams(temperature=1.0, top_p=0.9), LOGITS)
    kept = int((p > 0).sum())
    assert full[: kept - 1].sum() < 0.9 <= full[:kept].sum()


def test_min_p_drops_tokens_below_fraction_of_max():
    p = dist(SamplingParams(temperature=1.0, min_p=0.3), LOGITS)
    full = torch.softmax(torch.tensor(LOGITS), -1)
    assert torch.equal(p > 0, full >= 0.3 * full.max())


def test_temperature_sharpens():
    hot = dist(SamplingParams(temperature=2.0), LOGITS)
    cold = dist(SamplingParams(temperature=0.5), LOGITS)
    assert cold[0] > hot[0]
    assert math.isclose(
        float(cold[0]), float(torch.softmax(torch.tensor(LOGITS) / 0.5, -1)[0]), rel_tol=1e-5
    )


def test_penalties():
    flat = [0.0] * V
    rep = dist(SamplingParams(temperature=1.0, repetition_penalty=2.0), [2.0] * V, history=[1])
    assert rep[1] < rep[0]
    freq = dist(SamplingParams(temperature=1.0, frequency_penalty=1.0), flat, [5, 3, 2, 2], 1)
    assert freq[2] < freq[3] < freq[0], "more often in the output = lower"
    assert freq[5] == freq[0], "prompt tokens are not counted"
    pres = dist(SamplingParams(temperature=1.0, presence_penalty=1.0), flat, [5, 3, 2, 2], 1)
    assert math.isclose(float(pres[2]), float(pres[3]), rel_tol=1e-6) and pres[2] < pres[0]


def test_logit_bias_moves_logits_and_min_tokens_bans_the_stops_until_then():
    flat = [0.0] * V
    biased = dist(SamplingParams(temperature=1.0, logit_bias={"3": 2.0, "6": -100}), flat)
    assert math.isclose(float(biased[3] / biased[0]), math.exp(2.0), rel_tol=1e-5)
    assert float(biased[6]) < 1e-40 and biased[1] == biased[0]
    greedy = dist(SamplingParams(temperature=0.0, logit_bias=[[7, 20.0]]), LOGITS)
    assert greedy.tolist() == [0.0] * 7 + [1.0], "the bias moves the greedy choice"
    sampler = Sampler(2, V, torch.device("cpu"))
    params = SamplingParams(temperature=0.0, min_tokens=2)
    for output, banned in (([], True), ([5], True), ([5, 5], False)):
        row = Row(params, 3 + len(output), [1, 2, 3, *output], 3, stops=(0, 4))
        p = sampler.distribution(torch.tensor([LOGITS]), [row])[0]
        # banned: token 0 (LOGITS' argmax) and 4 cannot come; the argmax is then token 1
        assert int(p.argmax()) == (1 if banned else 0) and float(p[4]) == 0.0
    assert (
        SamplingParams(min_tokens=1).adjusts_logits
        and SamplingParams(logit_bias={1: 1}).adjusts_logits
    )
    assert not SamplingParams(temperature=0.0).adjusts_logits
    assert SamplingParams(temperature=0.0).takes_argmax
    assert not SamplingParams(temperature=0.0, min_tokens=1).takes_argmax


def test_logit_bias_travels_as_sorted_pairs():
    params = SamplingParams(logit_bias={"9": -1, "2": 0.5}, min_tokens=3)
    assert params.logit_bias == ((2, 0.5), (9, -1.0))
    data = params.to_dict()
    assert data["logit_bias"] == [[2, 0.5], [9, -1.0]] and data["min_tokens"] == 3
    assert SamplingParams.from_dict(data) == params


def test_seeded_sampling_follows_the_distribution():
    sampler = Sampler(1, V, torch.device("cpu"))
    params = SamplingParams(temperature=1.0, seed=7)
    want = torch.softmax(torch.tensor(LOGITS), -1)
    counts: Counter = Counter()
    n = 4000
    for pos in range(n):
        rows = [Row(params, pos, [], 0)]
        counts[sampler.sample(sampler.distribution(torch.tensor([LOGITS]), rows), rows)[0]] += 1
    for tok in range(4):
        assert abs(counts[tok] / n - float(want[tok])) < 0.03


def test_all_greedy_shortcut_picks_the_tokens_of_the_full_path():
    """An all-greedy batch takes the argmax directly; the full path (distribution, inverse CDF)
    picks the same token per row, ties (first maximum) included. With one sampled row the
    batch takes the full path."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen)
    logits[2, [7, 30]] = 9.0  # a tie: the first maximum wins
    greedy = [Row(SamplingParams(temperature=0.0, seed=i), 5 + i, [], 0) for i in range(6)]
    sampler = Sampler(6, 50, torch.device("cpu"))
    full = sampler.sample(sampler.distribution(logits.clone(), greedy), greedy)
    assert sampler.sample_logits(logits.clone(), greedy).tolist() == full
    assert full[2] == 7
    mixed = [*greedy[:5], Row(SamplingParams(temperature=1.0, seed=9), 10, [], 0)]
    picked = sampler.sample_logits(logits.clone(), mixed).tolist()
    assert picked == sampler.sample(sampler.distribution(logits.clone(), mixed), mixed)
    assert picked[:5] == full[:5]


def test_uniform_is_keyed_by_seed_and_position():
    assert uniform(1, 5) == uniform(1, 5)
    assert len({uniform(1, p) for p in range(100)}) == 100
    assert uniform(1, 5) != uniform(2, 5)
    assert all(0.0 <= uniform(s, p) < 1.0 for s in range(20) for p in range(20))


def test_batched_uniforms_are_the_scalar_ones_to_the_bit():
    """The sampler draws a batch's uniforms in numpy; each must be `uniform`'s exactly (a
    recorded log replays the tokens only then), over seeds past 64 bits and negative ones."""
    rng = random.Random(3)
    seeds = [rng.randrange(-(2**70), 2**70) for _ in range(2000)] + [0, -1, 2**64 - 1]
    positions = [rng.randrange(0, 2**40) for _ in seeds]
    for stream in (SAMPLE, ACCEPT, DRAFT):
        batched = uniforms(seeds, positions, stream).tolist()
        assert batched == [uniform(s, p, stream) for s, p in zip(seeds, positions, strict=True)]


def test_top_logprobs_are_log_softmax():
    logits = torch.tensor([LOGITS])
    ((chosen, top),) = top_logprobs(logits, [2], 3)
    ref = torch.log_softmax(logits[0], -1)
    assert math.isclose(chosen, float(ref[2]), rel_tol=1e-6)
    assert [t for t, _ in top] == [0, 1, 2]
    # several rows at once: each row its own chosen token and its own top-n
    rows = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    tokens = [3, 49, 0, 17]
    for row, tok, (chosen, top) in zip(rows, tokens, top_logprobs(rows, tokens, 2), strict=True):
        ref = torch.log_softmax(row, -1)
        assert math.isclose(chosen, float(ref[tok]), rel_tol=1e-6)
        values, ids = torch.topk(ref, 2)
        assert [t for t, _ in top] == ids.tolist()
        pairs = zip(top, values.tolist(), strict=True)
        assert all(math.isclose(v, r, rel_tol=1e-6) for (_, v), r in pairs)
    assert top_logprobs(rows, tokens, 0)[1] == [float(torch.log_softmax(rows[1], -1)[49]), []]


def test_stop_strings_and_stop_ids_end_to_end(smol_engine, chat_prompts):
    (free,) = smol_engine.generate(
        [chat_prompts[0]], SamplingParams(temperature=0.0, max_tokens=10)
    )
    assert free.text.startswith("The capital of France is Paris")
    (cut,) = smol_engine.generate(
        [chat_prompts[0]], SamplingParams(temperature=0.0, max_tokens=10, stop=("France",))
    )
    assert cut.text == "The capital of " and cut.finish_reason == "stop"
    (kept,) = smol_engine.generate(
        [chat_prompts[0]],
        SamplingParams(
            temperature=0.0,
            max_tokens=10,
            stop=("capital", "France"),
            include_stop_str_in_output=True,
        ),
    )
    assert kept.text == "The capital" and kept.finish_reason == "stop"
    stop_id = free.token_ids[2]
    (by_id,) = smol_engine.generate(
        [chat_prompts[0]], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(stop_id,))
    )
    assert by_id.token_ids == free.token_ids[:3] and by_id.finish_reason == "stop"
    (eos,) = smol_engine.generate([chat_prompts[0]], SamplingParams(temperature=0.0, max_tokens=40))
    assert eos.finish_reason == "stop" and eos.token_ids[-1] == 2
    (ign,) = smol_engine.generate(
        [chat_prompts[0]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    assert len(ign.token_ids) == 12 and ign.finish_reason == "length"


def test_logit_bias_and_min_tokens_end_to_end(smol_engine, chat_prompts):
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    (free,) = smol_engine.generate([chat_prompts[0]], greedy)
    assert free.finish_reason == "stop" and len(free.token_ids) < 30  # a short answer, then EOS
    forced = free.token_ids[1]
    (pushed,) = smol_engine.generate(
        [chat_prompts[0]], SamplingParams(temperature=0.0, max_tokens=6, logit_bias={forced: 100})
    )
    assert pushed.token_ids == [forced] * 6
    (banned,) = smol_engine.generate(
        [chat_prompts[0]], SamplingParams(temperature=0.0, max_tokens=3, logit_bias={forced: -100})
    )
    assert banned.token_ids[0] == free.token_ids[0] and banned.token_ids[1] != forced
    n = len(free.token_ids) + 5
    (longer,) = smol_engine.generate(
        [chat_prompts[0]], SamplingParams(temperature=0.0, max_tokens=40, min_tokens=n)
    )
    assert 2 not in longer.token_ids[:n] and len(longer.token_ids) >= n
    assert longer.token_ids[: len(free.token_ids) - 1] == free.token_ids[:-1]
    (no_stop_yet,) = smol_engine.generate(
        [chat_prompts[0]],
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5, stop=("France",)),
    )  # "France" is the 4th token: not matched before the 5th, nor after it
    assert no_stop_yet.text.startswith("The capital of France is")
    stop_id = free.token_ids[2]
    (late,) = smol_engine.generate(
        [chat_prompts[0]],
        SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(stop_id,), min_tokens=4),
    )
    assert stop_id not in late.token_ids[:4]


def test_logprobs_returned_per_token(smol_engine, chat_prompts):
    (done,) = smol_engine.generate(
        [chat_prompts[0]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3)
    )
    assert len(done.logprobs) == 4
    for tok, (chosen, top) in zip(done.token_ids, done.logprobs, strict=True):
        assert len(top) == 3 and top[0][0] == tok and math.isclose(top[0][1], chosen)


def test_filter_passes_leave_each_row_as_alone():
    """Rows filtered in passes of a few rows at once (here 3) get the very distribution each
    gets alone: min-p, top-k (ties with the k-th kept), top-p, greedy and unfiltered rows mixed,
    across the passes' edges."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(10, 50, generator=gen)
    logits[4, :6] = 3.0  # a tie across the top-k cut
    params = [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=4),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.5, min_p=0.01),
        SamplingParams(temperature=1.0, top_p=0.99),
        SamplingParams(temperature=1.0, top_k=50),
        SamplingParams(temperature=0.5, top_p=0.3),
    ]
    rows = [Row(p, 3, [], 0) for p in params]
    batch = Sampler(10, 50, torch.device("cpu"), filter_elements=150)
    assert batch.filter_rows == 3
    together = batch.distribution(logits.clone(), rows)
    for i, row in enumerate(rows):
        alone = Sampler(1, 50, torch.device("cpu")).distribution(logits[i : i + 1].clone(), [row])
        assert torch.equal(together[i], alone[0]), i
    assert int((together[4] > 0).sum()) == 6, "the tie at the 4th value keeps all six"
    assert int((together[1] > 0).sum()) == 5 and int((together[2] > 0).sum()) == 1
    assert int((together[5] > 0).sum()) == 50 and int((together[8] > 0).sum()) == 50


def test_cpu_cuts_on_candidates_equal_the_whole_sort():
    """On the CPU a top-k or top-p cut is tried on each row's few most probable tokens first;
    where it falls inside them the distribution equals the whole sort's to the bit, ties by
    token id included, and where it does not (flat rows, a k past the candidates, a tie across
    their edge) the rows are sorted whole."""
    gen = torch.Generator().manual_seed(11)
    peaked = torch.randn(8, 50, generator=gen) * 4.0
    peaked[3, [4, 9, 17]] = peaked[3].max() + 1.0  # a tie at the top
    flat = torch.randn(4, 50, generator=gen) * 0.1
    tie_edge = -torch.arange(50, dtype=torch.float32)
    tie_edge[:6] = torch.arange(10.0, 4.0, -1.0)
    tie_edge[[6, 9, 31, 40]] = 4.0  # the 7th to 10th values tie, across the 8 candidates' edge
    params = [
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.8),
        SamplingParams(temperature=1.0, top_p=0.6, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, top_k=20),  # past the candidates
        SamplingParams(temperature=0.5, top_p=0.3),
        SamplingParams(temperature=1.0, top_p=0.95),
    ]

    def both(logits: torch.Tensor, rows: list[Row]) -> tuple[torch.Tensor, Sampler]:
        n = len(rows)
        fast = Sampler(n, 50, torch.device("cpu"), candidates=8)
        whole = Sampler(n, 50, torch.device("cpu"), candidates=50)
        got = fast.distribution(logits.clone(), rows).clone()
        assert torch.equal(got, whole.distribution(logits.clone(), rows))
        return got, fast

    rows = [Row(p, 3, [], 0) for p in params]
    both(peaked, rows)
    _, fast = both(peaked[:5], rows[:5])
    assert not fast.sorted.any(), "the candidates sufficed: nothing was sorted whole"
    _, fast = both(flat, [Row(SamplingParams(temperature=1.0, top_p=0.9), 3, [], 0)] * 4)
    assert fast.sorted.any(), "a flat row's top-p cut lies past 8 candidates"
    tie = [Row(SamplingParams(temperature=1.0, top_k=7), 3, [], 0)]
    kept, fast = both(tie_edge[None], tie)
    assert fast.sorted.any() and int((kept > 0).sum()) == 10, "the 7th value's tie: 10 kept"


def test_a_stop_string_is_found_where_it_ends_past_the_step_s_start():
    from memstep.core.output_book import _find_stop

    text = "one two, three."
    assert _find_stop(text, (",", ", three"), 5) == (7, 14)  # the longest at the first start
    assert _find_stop(text, ("two",), 7) is None  # it ended at 7: matched then, or never
    assert _find_stop(text, ("two",), 6) == (4, 7)  # straddling the start


def test_prompt_logprobs_out_of_range_or_of_the_wrong_type_is_refused():
    for bad in (-1, 21):
        with pytest.raises(InvalidRequest, match="prompt_logprobs must be in"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        SamplingParams.from_dict({"prompt_logprobs": "3"})
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams.from_dict({"prompt_logprobs": None}).prompt_logprobs is None
