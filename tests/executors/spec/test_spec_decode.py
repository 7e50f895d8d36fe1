"""Speculative decoding is lossless: greedy equals greedy, sampled tokens follow the target."""

from __future__ import annotations

import pytest
import torch

from memstep.cli.traffic import staggered
from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams
from memstep.executors.process.inprocess import local_engine
from memstep.executors.runtime.random_stream import ACCEPT, uniform
from memstep.executors.runtime.sampler import Row
from memstep.executors.spec.decoder import accept_drafts, accept_greedy
from memstep.executors.spec.proposers import ngram_propose

# p0 outlasts its 3 steps alone even if every draft is accepted (1 + 2 x 5 tokens at k = 4)
MAX_TOKENS = [20] + [6 + 3 * i for i in range(1, 8)]


def greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i], ignore_eos=True)


@pytest.fixture(scope="module")
def reference(smol_engine, chat_prompts):
    params = [greedy(i) for i in range(8)]
    return [c.token_ids for c in smol_engine.generate(chat_prompts, params)]


def spec_engine(method: str, **options) -> Engine:
    """SmolLM2 in float32, unquantized (as `smol_engine`, the reference), speculating."""
    return local_engine(
        EngineConfig(dtype="float32", quantization="none", speculative_method=method, **options)
    )


def run_crossing(engine: Engine, prompts) -> tuple[dict[str, list[int]], str, dict]:
    """3 requests (spec), then 5 more join (no_spec), then they drain (spec again)."""
    kinds: list[str] = []
    spans: dict[str, set] = {}
    engine.sinks.append(
        lambda r: (
            type(r).__name__ == "StepFinished"
            and (
                kinds.append(r.kind),
                [spans.setdefault(rid, set()).add(r.kind) for rid, _ in r.sampled],
            )
        )
    )
    ids = [f"p{i}" for i in range(8)]
    params = [greedy(i) for i in range(8)]
    outputs = staggered(engine, prompts[:8], params, request_ids=ids)
    engine.sinks.pop()
    tokens = dict(zip(ids, outputs, strict=True))
    return tokens, "".join("s" if k == "spec" else "n" for k in kinds), spans


@pytest.mark.parametrize(
    "method, k",
    [("ngram", 1), ("ngram", 3), ("ngram", 5), ("draft", 1), ("draft", 3), ("draft", 5)]
    + [("eagle", 1), ("eagle", 4)],
)
def test_greedy_spec_equals_greedy_across_threshold_crossings(method, k, reference, chat_prompts):
    engine = spec_engine(
        method, num_speculative_tokens=k, speculative_disable_by_batch_size=4, draft_layers=8
    )
    tokens, kinds, spans = run_crossing(engine, chat_prompts)
    for i in range(8):
        assert tokens[f"p{i}"] == reference[i], f"prompt {i} differs under {method} k={k}"
    assert kinds.startswith("s") and "sn" in kinds and "ns" in kinds, kinds
    # requests that started in spec continued in no_spec and vice versa
    assert spans["p0"] == {"spec", "no_spec"}
    assert any(spans[f"p{i}"] == {"spec", "no_spec"} for i in range(3, 8))
    assert engine.blocks.num_used == 0


def test_greedy_spec_equals_greedy_with_an_fp8_kv_cache(chat_prompts):
    """Verification reads the fp8 cache through the multi-token path, plain decoding through
    the one-token path: both see the same stored values, so greedy tokens agree.

    The reference runs the same arrivals without speculation, on fresh engines without prefix
    caching: with an fp8 cache, plain greedy text itself depends on the batches its prefill ran
    in (a last-bit difference in a padded group's attention can round a stored value to the
    next fp8 step; prompt 4 parts between one batch of 8 and these arrivals), and a session
    engine's cached prefixes from earlier tests made this test pass or fail by test order."""
    base = dict(
        dtype="float32", quantization="none", kv_cache_dtype="fp8", enable_prefix_caching=False
    )
    reference, plain_kinds, _ = run_crossing(local_engine(EngineConfig(**base)), chat_prompts)
    assert set(plain_kinds) == {"n"}
    cfg = EngineConfig(
        **base,
        speculative_method="ngram",
        num_speculative_tokens=3,
        speculative_disable_by_batch_size=4,
    )
    tokens, kinds, _ = run_crossing(local_engine(cfg), chat_prompts)
    for i in range(8):
        assert tokens[f"p{i}"] == reference[f"p{i}"], f"prompt {i} differs"
    assert "sn" in kinds and "ns" in kinds, kinds


@pytest.mark.parametrize(
    "method, tree", [("ngram", ()), ("draft", ()), ("eagle", ()), ("eagle", (3, 2))]
)
def test_logit_bias_and_min_tokens_are_lossless_under_speculation(
    method, tree, smol_engine, chat_prompts
):
    """Verify rows (and the draft model's own sampling) see a request's logit_bias and its ban
    on ending before min_tokens at each row's own position, a draft tree's nodes too: greedy
    equals plain greedy, in a batch beside a request without them."""
    (free,) = smol_engine.generate([chat_prompts[0]], SamplingParams(temperature=0.0))
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=30,
            min_tokens=len(free.token_ids) + 8,
            logit_bias={free.token_ids[3]: -100, free.token_ids[5]: 4.0},
        ),
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=25),
    ]
    prompts = [chat_prompts[0], chat_prompts[1], chat_prompts[0]]
    reference = [c.token_ids for c in smol_engine.generate(prompts, params)]
    assert reference[0] != free.token_ids[: len(reference[0])], "the bias changed the output"
    assert len(reference[2]) >= 25 and 2 not in reference[2][:25]
    engine = spec_engine(
        method,
        speculative_tree=tree,
        num_speculative_tokens=3,
        draft_layers=30,
        speculative_auto_disable=False,
    )
    steps = []
    engine.sinks.append(lambda r: type(r).__name__ == "StepFinished" and steps.append(r))
    got = [c.token_ids for c in engine.generate(prompts, params)]
    assert got == reference
    assert sum(r.num_accepted for r in steps) > 0, "drafts were verified and taken"


def test_acceptance_is_counted(chat_prompts):
    engine = spec_engine("draft", draft_layers=30)
    finished = []
    engine.sinks.append(lambda r: type(r).__name__ == "StepFinished" and finished.append(r))
    engine.generate(
        chat_prompts[:2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    proposed = sum(r.num_proposed for r in finished)
    accepted = sum(r.num_accepted for r in finished)
    assert proposed > 0 and accepted == proposed, "a draft identical to the target is always right"


def test_greedy_acceptance_is_the_rule_with_one_hot_targets():
    """The greedy shortcut appends exactly what the general rule does with a one-hot p, with
    or without a draft distribution."""
    gen = torch.Generator().manual_seed(0)
    vocab = 5
    for case in range(300):
        n = int(torch.randint(0, 4, (1,), generator=gen))
        choices = torch.randint(0, vocab, (n + 1,), generator=gen).tolist()
        drafts = [c if torch.rand(1, generator=gen) < 0.6 else (c + 1) % vocab for c in choices[:n]]
        p = torch.nn.functional.one_hot(torch.tensor(choices), vocab).float()
        q = torch.softmax(torch.randn(max(n, 1), vocab, generator=gen), -1) if case % 2 else None
        rows = [
            Row(SamplingParams(temperature=0.0, seed=case), 10 + j, [], 0) for j in range(n + 1)
        ]
        expected = accept_drafts(p, rows, drafts, q, torch.empty(2, vocab))
        assert accept_greedy(choices, drafts) == expected


def test_ngram_lookup():
    assert ngram_propose([1, 2, 3, 4, 1, 2], 2, 3, 1) == [3, 4]
    assert ngram_propose([5, 6, 7], 3, 3, 1) == []
    assert ngram_propose([1, 2, 9, 1, 2, 8, 1, 2], 1, 2, 1) == [8], "latest occurrence wins"


# --- the acceptance rule, statistically -------------------------------------------------------

P = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
Q = torch.tensor([0.40, 0.05, 0.25, 0.10, 0.10, 0.10])
TRIALS = 12000


def first_tokens(rule, q_is_none: bool) -> torch.Tensor:
    counts = torch.zeros(len(P))
    gen = torch.Generator().manual_seed(0)
    for seed in range(TRIALS):
        params = SamplingParams(temperature=1.0, seed=seed)
        rows = [Row(params, 10, [], 0), Row(params, 11, [], 0)]
        q = None if q_is_none else Q[None]
        draft = 1 if q_is_none else int(torch.multinomial(Q, 1, generator=gen))
        tokens, _ = rule(torch.stack([P, P]), rows, [draft], q, torch.empty(2, len(P)))
        counts[tokens[0]] += 1
    return counts


def chi_square(counts: torch.Tensor) -> float:
    expected = P * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


CRITICAL = 20.5  # chi-square, 5 degrees of freedom, p = 0.001


@pytest.mark.parametrize("q_is_none", [False, True])
def test_sampled_tokens_follow_the_target_distribution(q_is_none):
    assert chi_square(first_tokens(accept_drafts, q_is_none)) < CRITICAL


def test_a_wrong_acceptance_rule_fails_the_same_test():
    def always_accept(p, rows, drafts, q, residual):
        return list(drafts), len(drafts)

    def resample_from_p(p, rows, drafts, q, residual):  # rejects right, then forgets the residual
        u = uniform(rows[0].params.seed, rows[0].position, ACCEPT)
        if u < min(1.0, float(p[0, drafts[0]] / q[0, drafts[0]])):
            return [drafts[0]], 1
        return [int(torch.multinomial(p[0], 1))], 0

    assert chi_square(first_tokens(always_accept, False)) > CRITICAL
    assert chi_square(first_tokens(resample_from_p, False)) > CRITICAL
