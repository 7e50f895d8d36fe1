"""Text <-> token ids, and the chat template, for each kind of model source.

The GGUF tokenizer is rebuilt from the file's own metadata (vocabulary, merges, special tokens);
random: models get a byte tokenizer so that text still round-trips.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from memstep.core.model_source import ModelError, ModelSource, gguf_field, read_gguf


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


class HFTokenizer:
    """A `tokenizers.Tokenizer` plus a Jinja chat template."""

    def __init__(self, tok: Any, chat_template: str | None, eos: tuple[int, ...], bos: str):
        self._tok = tok
        self._template = chat_template
        self.eos_token_ids = eos
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._bos = bos

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if not self._template:
            return "".join(m["content"] for m in messages)
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self._template)
        return template.render(messages=messages, add_generation_prompt=True, bos_token=self._bos)


class ByteTokenizer:
    """UTF-8 bytes shifted past a few special ids; for random: models whose vocab is arbitrary."""

    OFFSET = 3

    def __init__(self, vocab_size: int, eos: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos
        # each id's byte (an empty string for end-of-sequence ids), looked up at C speed
        self._bytes = [
            b"" if i in eos else bytes([(i - self.OFFSET) % 256]) for i in range(vocab_size)
        ]

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return b"".join(map(self._bytes.__getitem__, ids)).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


def _gguf_tokenizer(path: Path) -> HFTokenizer:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    reader = read_gguf(path)
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelError(f"unsupported GGUF tokenizer {kind!r}: only byte-level BPE (gpt2)")
    tokens = list(gguf_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges")]
    types = list(gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = RawTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    # the same pre-tokenizer Hugging Face builds from this GGUF: GPT-2's byte-level regex
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types, strict=False) if ty == 3]  # CONTROL tokens
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    eos = (int(gguf_field(reader, "tokenizer.ggml.eos_token_id", 2)),)
    bos_id = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    bos = tokens[bos_id] if bos_id is not None else ""
    return HFTokenizer(tok, gguf_field(reader, "tokenizer.chat_template"), eos, bos)


def _hf_tokenizer(folder: Path, eos: tuple[int, ...]) -> HFTokenizer:
    from tokenizers import Tokenizer as RawTokenizer

    file = folder / "tokenizer.json"
    if not file.is_file():
        raise ModelError(f"{folder} has no tokenizer.json")
    tok = RawTokenizer.from_file(str(file))
    template, bos = None, ""
    cfg_file = folder / "tokenizer_config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        template = cfg.get("chat_template")
        bos_tok = cfg.get("bos_token")
        bos = bos_tok if isinstance(bos_tok, str) else ""
    return HFTokenizer(tok, template, eos, bos)


def load_tokenizer(source: ModelSource, vocab_size: int, eos: tuple[int, ...]) -> Tokenizer:
    if source.tokenizer is not None:
        return load_tokenizer_file(source.tokenizer, eos)
    if source.kind == "gguf":
        assert source.path is not None
        return _gguf_tokenizer(source.path)
    if source.kind == "hf":
        assert source.path is not None
        return _hf_tokenizer(source.path, eos)
    return ByteTokenizer(vocab_size, eos)


def load_tokenizer_file(path: Path, eos: tuple[int, ...]) -> HFTokenizer:
    """`--tokenizer`: a tokenizer.json (no chat template; `eos` stays the model's) or the
    tokenizer of a .gguf file (its own template and end-of-sequence id)."""
    if path.suffix == ".gguf":
        return _gguf_tokenizer(path)
    from tokenizers import Tokenizer as RawTokenizer

    return HFTokenizer(RawTokenizer.from_file(str(path)), None, eos, "")


def gguf_tokenizer_json(path: Path) -> str:
    """The tokenizer of a .gguf file as tokenizer.json text (a few MB, without the weights)."""
    return str(_gguf_tokenizer(path)._tok.to_str())
