"""The executor's grammar parts on random:tiny's byte tokenizer: a matcher brought to tokens
by rollback equals one fed them fresh, the sampler masks constrained rows only, a completed
grammar allows only the end of sequence, and the memory plan counts the bitmask."""

from __future__ import annotations

import pytest
import torch

from memstep.core.model_source import model_config, resolve
from memstep.core.sampling_params import SamplingParams
from memstep.executors.runtime.guide import GrammarBook, mask_words
from memstep.executors.runtime.sampler import Row, Sampler, sampler_nbytes

SOURCE = resolve("random:tiny")
MC = model_config(SOURCE)
BOOK = GrammarBook(SOURCE, MC.vocab_size, MC.eos_token_ids)
REGEX = ("regex", "a(b|c)+d")


def _ids(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]  # ByteTokenizer's ids


def _any_of(chars: str) -> list[int]:
    """Every id whose byte is one of `chars` (random:tiny's ids wrap around the 256 bytes)."""
    tok = BOOK.tokenizer()
    wanted = {bytes([b]) for b in chars.encode()}
    return [i for i in range(MC.vocab_size) if tok.decode_bytes([i]) in wanted]


def _allowed(guide, output: list[int]) -> list[int]:
    words = torch.zeros(mask_words(MC.vocab_size), dtype=torch.int32)
    guide.mask_into(output, words)
    bits = ((words[:, None] >> torch.arange(32)) & 1).flatten()[: MC.vocab_size]
    return bits.nonzero().flatten().tolist()


def test_rollback_to_other_tokens_masks_as_a_fresh_matcher():
    moved = BOOK.guide(REGEX)
    assert _allowed(moved, _ids("abbb")) == _any_of("bcd")
    assert moved.fed == _ids("abbb")
    # a refused draft: the rows after it are left open, and the matcher keeps the good part
    assert len(_allowed(moved, _ids("abx"))) == MC.vocab_size and moved.fed == _ids("ab")
    fresh = BOOK.guide(REGEX)
    assert _allowed(moved, _ids("acc")) == _allowed(fresh, _ids("acc")) == _any_of("bcd")


def test_a_completed_grammar_allows_only_the_end_of_sequence():
    guide = BOOK.guide(("choice", '["yes"]'))
    assert _allowed(guide, _ids("yes")) == list(MC.eos_token_ids)


def test_each_distinct_constraint_compiles_once():
    before = BOOK.stats.compiled
    BOOK.guide(("regex", "z+")), BOOK.guide(("regex", "z+"))
    assert BOOK.stats.compiled == before + 1 and BOOK.stats.hits >= 1


def test_the_sampler_masks_constrained_rows_and_leaves_the_others_alone():
    sampler = Sampler(4, MC.vocab_size, torch.device("cpu"))
    logits = torch.randn(3, MC.vocab_size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    plain = SamplingParams(temperature=1.0, seed=1)
    guided = SamplingParams(temperature=1.0, seed=1, guided_regex="a(b|c)+d")
    rows = [
        Row(plain, 0, [], 0),
        Row(guided, 1, _ids("a"), 0, BOOK.guide(REGEX)),
        Row(plain, 0, [], 0),
    ]
    sampler.constrain(logits, rows)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == _any_of("bc")
    tokens = sampler.sample_logits(logits, rows).tolist()
    assert tokens[1] in _any_of("bc")


def test_the_memory_plan_counts_the_bitmask():
    sampler = Sampler(8, MC.vocab_size, torch.device("cpu"))
    assert sampler.nbytes == sampler_nbytes(8, MC.vocab_size, in_place_logits=False)
    parts = (sampler.mask_host, sampler.bit, sampler.bits, sampler.forbid)
    mask = sum(t.numel() * t.element_size() for t in parts)
    words = 8 * mask_words(MC.vocab_size)
    assert mask == words * 4 + 128 + words * 32 * 4 + 8 * MC.vocab_size
    # a plan without the bitmask falls short of what the sampler holds
    assert sampler_nbytes(8, MC.vocab_size, False) - mask < sampler.nbytes


def _mixed_batch() -> tuple[torch.Tensor, list[Row]]:
    """Five rows: plain, a regex part-way, a regex that allows every token after a refused
    draft, a completed choice (end of sequence only), plain."""
    logits = torch.randn(5, MC.vocab_size, generator=torch.Generator().manual_seed(1))
    plain = SamplingParams(temperature=1.0, seed=1)
    guided = SamplingParams(temperature=1.0, seed=1, guided_regex="a(b|c)+d")
    yes = SamplingParams(temperature=1.0, seed=1, guided_choice=["yes"])
    rows = [
        Row(plain, 0, [], 0),
        Row(guided, 2, _ids("ab"), 0, BOOK.guide(REGEX)),
        Row(guided, 2, _ids("ax"), 0, BOOK.guide(REGEX)),
        Row(yes, 3, _ids("yes"), 0, BOOK.guide(yes.constraint)),
        Row(plain, 0, [], 0),
    ]
    return logits, rows


def _reference(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """The mask of each constrained row unpacked bit by bit in torch, applied with masked_fill."""
    out = logits.clone()
    for i, row in enumerate(rows):
        if row.guide is not None:
            allowed = torch.zeros(MC.vocab_size, dtype=torch.bool)
            allowed[_allowed(BOOK.guide(row.params.constraint), row.history)] = True
            out[i].masked_fill_(~allowed, float("-inf"))
    return out


def _drafts_batch() -> tuple[torch.Tensor, list[Row]]:
    """A speculative step's rows: one guide for the row and the rows after its two drafts."""
    logits = torch.randn(3, MC.vocab_size, generator=torch.Generator().manual_seed(2))
    guided = SamplingParams(temperature=1.0, seed=1, guided_regex="a(b|c)+d")
    guide = BOOK.guide(REGEX)
    rows = [Row(guided, 1 + j, _ids("abd"[: 1 + j]), 0, guide) for j in range(3)]
    return logits, rows


@pytest.mark.parametrize("batch", [_mixed_batch, _drafts_batch])
def test_the_host_and_the_device_paths_mask_as_the_bits_say(batch):
    logits, rows = batch()
    want = _reference(logits, rows)
    host = Sampler(8, MC.vocab_size, torch.device("cpu"))
    on_host = logits.clone()
    host.constrain(on_host, rows)
    device = Sampler(8, MC.vocab_size, torch.device("cpu"))
    device.mask = torch.zeros_like(device.mask_host)  # the device path, on the CPU
    on_device = logits.clone()
    device.constrain(on_device, rows)
    assert torch.equal(on_host, want) and torch.equal(on_device, want)
    if batch is _mixed_batch:
        assert torch.isfinite(want[3]).nonzero().flatten().tolist() == list(MC.eos_token_ids)
        assert torch.equal(want[2], logits[2])  # a row that allows everything is untouched
    else:  # after "ab": b, c or d; after "abd": the end only
        assert torch.isfinite(want[1]).nonzero().flatten().tolist() == _any_of("bcd")
        assert torch.isfinite(want[2]).nonzero().flatten().tolist() == list(MC.eos_token_ids)
    warmed = logits.clone()
    device.warm_mask(warmed)  # the warm-up's pass allows every token
    assert torch.equal(warmed, logits)


def test_a_byte_table_in_the_wrong_bit_order_is_caught(monkeypatch):
    import numpy as np

    from memstep.executors.runtime import bitmask

    swapped = bitmask.BYTE_BIAS[:, ::-1].copy()
    monkeypatch.setattr(bitmask, "BYTE_BIAS", swapped)
    logits, rows = _mixed_batch()
    got = logits.clone()
    Sampler(8, MC.vocab_size, torch.device("cpu")).constrain(got, rows)
    assert not torch.equal(got, _reference(logits, rows))
    assert np.isneginf(swapped).any()


def test_allows_all_reads_only_the_vocabulary_bits():
    import numpy as np

    from memstep.executors.runtime.bitmask import allows_all

    words = np.full(mask_words(70), -1, dtype=np.int32)  # 70 tokens: 6 bits of the last word
    words[-1] = 0b111111
    assert allows_all(words, 70)
    words[-1] = 0b011111  # token 69 forbidden
    assert not allows_all(words, 70)
    words[-1] = -1 & ~(1 << 10)  # a bit past the vocabulary: ignored
    assert allows_all(words, 70)
    words[0] = ~1  # token 0 forbidden
    assert not allows_all(words, 70)


def test_a_random_model_with_another_model_s_tokenizer_gets_a_grammar_that_ends():
    """random:llama-3.1-8b with SmolLM2's tokenizer (the H200 benchmarks' setup): the model's end
    ids (128001, 128009) lie past the tokenizer's 49,152 tokens, which llguidance refuses; the
    grammar ends on the tokenizer's own end of text, which the mask swaps for the model's."""
    from memstep.core.model_source import shipped_gguf_path
    from memstep.core.tokenizer import load_tokenizer

    source = resolve("random:llama-3.1-8b", 0, str(shipped_gguf_path()))
    mc = model_config(source)
    book = GrammarBook(source, mc.vocab_size, mc.eos_token_ids)
    guide = book.guide(("regex", "yes|no"))
    words = torch.zeros(mask_words(mc.vocab_size), dtype=torch.int32)
    guide.mask_into([], words)
    bits = ((words[:, None] >> torch.arange(32)) & 1).flatten()[: mc.vocab_size]
    assert 0 < len(bits.nonzero()) < 49152 and not bits[mc.eos_token_ids[0]]
    done = load_tokenizer(source, mc.vocab_size, mc.eos_token_ids).encode("yes")
    guide.mask_into(done, words)
    bits = ((words[:, None] >> torch.arange(32)) & 1).flatten()[: mc.vocab_size]
    assert bits.nonzero().flatten().tolist() == [mc.eos_token_ids[0]]
