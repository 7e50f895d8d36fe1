"""Incremental output text equals decoding the whole output, token by token or in bursts."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from memstep.core.detokenizer import ByteText, IncrementalText
from memstep.core.tokenizer import ByteTokenizer, HFTokenizer

TEXTS = [
    "The capital of France is Paris. Émile's café serves crème brûlée — 美味しい 🍞🥖!",
    "  leading spaces, tabs\tand\nnew lines,   runs of   spaces",
    "日本語のテキストと emoji 👩‍👩‍👧 mixed with ASCII code: def f(x): return x**2",
]


def grown(tok, ids: list[int], burst: int, seed: int = 0) -> tuple[str, list[str]]:
    rng = random.Random(seed)
    inc = IncrementalText(tok.decode)
    pieces, n = [], 0
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, burst))
        pieces.append(inc.extend(ids[:n], final=n == len(ids)))
    return inc.text, pieces


@pytest.mark.parametrize("burst", [1, 4])
def test_smollm2_tokenizer_pieces_add_up_to_the_whole(smol_engine, burst):
    tok = smol_engine.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        whole, pieces = grown(tok, ids, burst)
        assert whole == "".join(pieces) == tok.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces), "a split character was shown half-done"


def test_byte_tokenizer_holds_back_a_split_character_until_it_completes():
    tok = ByteTokenizer(300, (2,))
    ids = tok.encode("é!")  # two bytes for é, then "!"
    inc = IncrementalText(tok.decode)
    assert inc.extend(ids[:1]) == ""  # half a character is not shown
    assert inc.extend(ids[:2]) == "é"
    assert inc.extend(ids[:3]) == "!"
    for text in TEXTS:
        ids = tok.encode(text)
        assert grown(tok, ids, 3)[0] == text


def test_a_final_call_releases_what_is_left():
    tok = ByteTokenizer(300, (2,))
    ids = tok.encode("é")[:1]  # the output ended inside a character
    inc = IncrementalText(tok.decode)
    assert inc.extend(ids) == ""
    assert inc.extend(ids, final=True) == "\ufffd" == tok.decode(ids)


def window_per_call_pieces(decode, ids: list[int], ends: list[int]) -> list[str]:
    """The pieces of the earlier detokenizer, which decoded the shown window afresh each call."""
    text, prefix, read, pieces = "", 0, 0, []
    for n in ends:
        final = n == len(ids)
        shown, full = decode(ids[prefix:read]), decode(ids[prefix:n])
        if full.endswith("\ufffd") and not final:
            pieces.append("")
            continue
        piece = full[len(shown) :] if full.startswith(shown) else decode(ids[:n])[len(text) :]
        text += piece
        read, prefix = n, max(0, n - 6)
        pieces.append(piece)
    return pieces


def outputs(tok, rng: random.Random, num: int = 60) -> Iterator[tuple[int, list[int], list[int]]]:
    """`num` outputs, (seed, ids, the lengths at which they are extended): odd seeds random ids
    (invalid UTF-8, ids that decode to nothing), even ones the ids of text; 1 or 3 tokens a call."""
    for seed in range(num):
        if seed % 2:
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 200))]
        else:
            ids = [i for text in rng.choices(TEXTS, k=4) for i in tok.encode(text)]
        ends, n = [], 0
        while n < len(ids):
            n = min(len(ids), n + rng.randint(1, rng.choice([1, 3])))
            ends.append(n)
        yield seed, ids, ends


@pytest.mark.parametrize("kind", ["bytes", "smollm2"])
def test_pieces_are_those_of_a_window_decoded_afresh_each_call(smol_engine, kind):
    """One decode a call streams the very pieces that two did, on random ids (invalid UTF-8,
    end-of-sequence ids that decode to nothing) as on text."""
    tok = ByteTokenizer(512, (1,)) if kind == "bytes" else smol_engine.tokenizer
    for seed, ids, ends in outputs(tok, random.Random(7)):
        inc = IncrementalText(tok.decode)
        pieces = [inc.extend(ids[:n], final=n == len(ids)) for n in ends]
        assert pieces == window_per_call_pieces(tok.decode, ids, ends), seed


def byte_text_pieces(table: list[bytes], ids: list[int], ends: list[int]) -> list[str]:
    inc = ByteText(table)
    return [inc.extend(ids[:n], final=n == len(ids)) for n in ends]


@pytest.mark.parametrize("kind", ["bytes", "smollm2"])
def test_byte_text_adds_up_to_the_whole_decode(smol_engine, kind):
    """Pieces made from the ids' bytes add up to `decode` of the whole output, on random ids
    (invalid UTF-8, special ids that decode to nothing) as on text, and no piece shows a character
    that a later token completes."""
    tok = ByteTokenizer(512, (1,)) if kind == "bytes" else smol_engine.tokenizer
    table = tok.token_bytes()
    assert table is not None and len(table) == tok.vocab_size
    for seed, ids, ends in outputs(tok, random.Random(11)):
        pieces = byte_text_pieces(table, ids, ends)
        assert "".join(pieces) == tok.decode(ids), seed
        if seed % 2 == 0:  # text: whole characters only
            assert not any("\ufffd" in p for p in pieces), seed


def test_byte_text_holds_a_split_character_until_it_completes():
    tok = ByteTokenizer(300, (2,))
    ids = tok.encode("é!€")  # two bytes, one, three
    inc = ByteText(tok.token_bytes())
    assert [inc.extend(ids[:n]) for n in range(1, 7)] == ["", "é", "!", "", "", "€"]
    inc = ByteText(tok.token_bytes())
    assert inc.extend(ids[:1]) == ""
    assert inc.extend(ids[:1], final=True) == "\ufffd" == tok.decode(ids[:1])
    assert inc.text == "\ufffd"


def test_the_engine_streams_bytes_where_the_tokenizer_has_them(smol_engine):
    """SmolLM2's byte-level BPE gets the table (each id's bytes read as `decode` reads that id);
    a tokenizer whose decoder is not byte-level gets none, and its requests decode windows."""
    from tokenizers import Tokenizer, decoders, models

    tok = smol_engine.tokenizer
    table = tok.token_bytes()
    assert table is not None and smol_engine.token_bytes == table
    for i in range(0, tok.vocab_size, 97):
        assert table[i].decode(errors="replace") == tok.decode([i]), i
    raw = Tokenizer(models.WordLevel({"a": 0, "##b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    raw.decoder = decoders.WordPiece()
    assert HFTokenizer(raw, None, (2,), "").token_bytes() is None


def test_a_model_with_a_smaller_tokenizer_streams_what_decode_gives(tmp_path):
    """A random model's ids past its tokenizer's vocabulary (random:llama-3.1-8b with SmolLM2's
    tokenizer on a GPU) decode to nothing, as the tokenizer's `decode` has them: the engine's
    table covers the model's vocabulary, and the text equals `decode` of the ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from memstep.core.config import EngineConfig
    from memstep.core.sampling_params import SamplingParams
    from memstep.executors.process.inprocess import local_engine

    vocab = {c: i for i, c in enumerate("abcdefghij")}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.save(str(tmp_path / "tokenizer.json"))
    cfg = EngineConfig(model="random:tiny", tokenizer=str(tmp_path / "tokenizer.json"))
    engine = local_engine(cfg.replace(num_threads=1))
    try:
        assert engine.token_bytes is not None and len(engine.token_bytes) == 512
        params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=3)
        (out,) = engine.generate(["abc"], params)
        assert any(i >= 10 for i in out.token_ids), "no id past the tokenizer's"
        assert out.text == engine.tokenizer.decode(out.token_ids)
    finally:
        engine.shutdown()
