"""Text <-> token ids, and chats -> token ids, for each kind of model source.

The GGUF tokenizer is rebuilt from the file's own metadata (vocabulary, merges, special tokens);
random: models get a byte tokenizer so that text still round-trips.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from memstep.core.chat_template import ChatTemplate
from memstep.core.model_source import ModelError, ModelSource, gguf_field, read_gguf
from memstep.core.sampling_params import InvalidRequest


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...

    def encode_chat(
        self,
        messages: list[dict[str, str]],
        special_tokens_in_messages: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]: ...

    def token_bytes(self) -> list[bytes] | None: ...

    def with_special_tokens(self, ids: list[int]) -> list[int]: ...

    def hf_config(self) -> dict[str, Any]: ...


class HFTokenizer:
    """A `tokenizers.Tokenizer` plus the model's chat template, compiled and checked at load.

    Prompt text (`encode`) is read as Hugging Face reads it: `<|im_start|>` in it is the control
    token.  A chat (`encode_chat`) is not: the text of a message stays plain text, so that a user
    cannot forge a turn, unless the caller asks for `special_tokens_in_messages`.
    """

    def __init__(
        self, tok: Any, chat_template: str | None, eos: tuple[int, ...], bos: str, pad: str = ""
    ):
        self._tok = tok
        self._chat_template, self._bos, self._pad = chat_template, bos, pad
        self._plain = _without_special_tokens(tok)
        self._special_ids = frozenset(
            i for i, added in tok.get_added_tokens_decoder().items() if added.special
        )
        self._added = _added_around(tok)
        self.eos_token_ids = eos
        eos_text = tok.id_to_token(eos[0]) if eos else None
        self._template = ChatTemplate(chat_template, bos, eos_text or "") if chat_template else None
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        """`ids` with the special tokens this tokenizer's post-processor adds around a text (a
        BOS, say; SmolLM2's adds none): Hugging Face's and vLLM's `add_special_tokens=True`."""
        before, after = self._added
        return [*before, *ids, *after]

    def hf_config(self) -> dict[str, Any]:
        """The tokenizer_config.json that goes beside tokenizer.json for transformers to load
        the tokenizer whole: its special tokens (pad: the model's own, else end-of-sequence, as
        SmolLM2's card sets it) and chat template; also vLLM's /tokenizer_info."""
        eos = self._tok.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._bos or None,
            "eos_token": eos,
            "pad_token": self._pad or eos,
            "chat_template": self._chat_template,
            "clean_up_tokenization_spaces": False,
        }

    def token_id(self, text: str) -> int | None:
        """The id of a token of the vocabulary by its text, None where it has none."""
        found = self._tok.token_to_id(text)
        return None if found is None else int(found)

    def tokenizer_json(self) -> str:
        """The tokenizer as tokenizer.json text (what a grammar engine builds its view from)."""
        return str(self._tok.to_str())

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def token_bytes(self) -> list[bytes] | None:
        """Each id's bytes, where `decode` joins the ids' bytes and reads them as UTF-8
        (byte-level BPE: GPT-2's, Llama 3's, SmolLM2's), special tokens as nothing; else None.
        Made on each call (the engine asks once) and checked id by id against `decode` (an id
        whose bytes read otherwise alone, where `decode` gives a whole text, is that text's
        bytes: an added token)."""
        return _byte_level_table(self._tok, self.vocab_size)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The chat as text, to show; `encode_chat` makes the ids (encoding this text would not)."""
        return "".join(text for text, _ in self._parts(messages))

    def encode_chat(
        self,
        messages: list[dict[str, str]],
        special_tokens_in_messages: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The chat's prompt ids; special-token text in a message is plain text unless allowed;
        `template_kwargs` are more variables for the chat template."""
        parts = self._parts(messages, template_kwargs)
        text = "".join(piece for piece, _ in parts)
        if special_tokens_in_messages:
            return self.encode(text)
        self._check_roles(messages)
        whole = self._tok.encode(text, add_special_tokens=False)
        if not self._special_in(whole, _content_spans(parts)):
            return list(whole.ids)  # the ids Hugging Face gives, when no message holds a control
        return [i for piece, is_content in parts for i in self._encode_part(piece, is_content)]

    def _encode_part(self, piece: str, is_content: bool) -> list[int]:
        tok = self._plain if is_content else self._tok
        return list(tok.encode(piece, add_special_tokens=False).ids)

    def _parts(
        self, messages: list[dict[str, str]], extra: dict[str, Any] | None = None
    ) -> list[tuple[str, bool]]:
        if self._template is None:
            return [(m["content"], True) for m in messages]
        return self._template.parts(messages, extra)

    def _special_in(self, enc: Any, spans: list[tuple[int, int]]) -> bool:
        """Whether a special token of `enc` covers any character of the `spans`."""
        return any(
            start < end_span and start_span < end
            for i, (start, end) in zip(enc.ids, enc.offsets, strict=True)
            if i in self._special_ids
            for start_span, end_span in spans
        )

    def _check_roles(self, messages: list[dict[str, str]]) -> None:
        for m in messages:
            if self._special_ids.intersection(self.encode(m["role"])):
                raise InvalidRequest(f"message role {m['role']!r} holds a special token")


def _added_around(tok: Any) -> tuple[list[int], list[int]]:
    """The ids `tok`'s post-processor puts before and after a text's (found around a probe)."""
    plain = list(tok.encode("a", add_special_tokens=False).ids)
    whole = list(tok.encode("a", add_special_tokens=True).ids)
    for start in range(len(whole) - len(plain) + 1):
        if whole[start : start + len(plain)] == plain:
            return whole[:start], whole[start + len(plain) :]
    raise ModelError("the tokenizer's post-processor changes a text's own tokens")


def _without_special_tokens(tok: Any) -> Any:
    """A copy of `tok` that reads special-token text, e.g. `<|im_start|>`, as plain text."""
    from tokenizers import Tokenizer as RawTokenizer

    plain = RawTokenizer.from_str(tok.to_str())
    plain.encode_special_tokens = True
    return plain


def _byte_level_table(tok: Any, vocab_size: int) -> list[bytes] | None:
    """`HFTokenizer.token_bytes`: None unless the decoder is byte-level and every id's bytes
    read as `decode([id])` does (or that text is whole, and is taken as the id's bytes)."""
    from tokenizers import decoders

    if not isinstance(tok.decoder, decoders.ByteLevel):
        return None
    byte_of = {c: b for b, c in enumerate(_byte_level_chars())}
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    table = []
    for i in range(vocab_size):
        piece = tok.id_to_token(i)
        if i in special or piece is None:
            table.append(b"")
        elif all(c in byte_of for c in piece):
            table.append(bytes(byte_of[c] for c in piece))
        else:
            table.append(piece.encode())
    texts = tok.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=True)
    for i, text in enumerate(texts):
        if table[i].decode(errors="replace") != text:
            if "\ufffd" in text:
                return None
            table[i] = text.encode()
    return table


def _byte_level_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte 0..255."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    chars, extra = [], 0
    for b in range(256):
        if b in kept:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _content_spans(parts: list[tuple[str, bool]]) -> list[tuple[int, int]]:
    """Character spans of the message contents in the joined text of `parts`."""
    spans, at = [], 0
    for piece, is_content in parts:
        if is_content:
            spans.append((at, at + len(piece)))
        at += len(piece)
    return spans


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

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes (empty for an end-of-sequence id)."""
        return list(self._bytes)

    def decode(self, ids: list[int]) -> str:
        return b"".join(map(self._bytes.__getitem__, ids)).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def encode_chat(
        self,
        messages: list[dict[str, str]],
        special_tokens_in_messages: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Bytes have no special tokens to forge, and no template to take variables: the
        options change nothing."""
        return self.encode(self.apply_chat_template(messages))

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        """Bytes have no special tokens to add."""
        return list(ids)

    def hf_config(self) -> dict[str, Any]:
        """Bytes have no Hugging Face form: no special tokens or template to name."""
        return {"tokenizer_class": None, "bos_token": None, "eos_token": None, "pad_token": None}


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
    _add_bos_eos(tok, reader, tokens, bos_id, eos[0])
    return HFTokenizer(tok, gguf_field(reader, "tokenizer.chat_template"), eos, bos)


def _add_bos_eos(tok: Any, reader: Any, tokens: list[str], bos_id: int | None, eos_id: int):
    """The BOS (and EOS) llama.cpp adds around a text where the file says so
    (`tokenizer.ggml.add_bos_token`, `add_eos_token`: a Llama 3 or Gemma GGUF; SmolLM2's adds
    none), as a post-processor: `with_special_tokens`, vLLM's add_special_tokens=True."""
    from tokenizers import processors

    before = bos_id if gguf_field(reader, "tokenizer.ggml.add_bos_token", False) else None
    after = eos_id if gguf_field(reader, "tokenizer.ggml.add_eos_token", False) else None
    if before is None and after is None:
        return
    parts = ["$A"]
    if before is not None:
        parts.insert(0, tokens[before])
    if after is not None:
        parts.append(tokens[after])
    special = {tokens[i]: i for i in (before, after) if i is not None}
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(parts), special_tokens=list(special.items())
    )


def _hf_tokenizer(folder: Path, eos: tuple[int, ...]) -> HFTokenizer:
    from tokenizers import Tokenizer as RawTokenizer

    file = folder / "tokenizer.json"
    if not file.is_file():
        raise ModelError(f"{folder} has no tokenizer.json")
    tok = RawTokenizer.from_file(str(file))
    template, bos, pad = None, "", ""
    cfg_file = folder / "tokenizer_config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        template = cfg.get("chat_template")
        bos, pad = _token_text(cfg.get("bos_token")), _token_text(cfg.get("pad_token"))
    return HFTokenizer(tok, template, eos, bos, pad)


def _token_text(given: Any) -> str:
    """A special token of tokenizer_config.json: its text, or an AddedToken map's content."""
    if isinstance(given, dict):
        given = given.get("content")
    return given if isinstance(given, str) else ""


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


def with_chat_template(tok: Tokenizer, template: str) -> Tokenizer:
    """`tok` with `template` (Jinja text) as its chat template, checked as a model's is."""
    if not isinstance(tok, HFTokenizer):
        raise ModelError("this model's tokenizer (bytes) takes no chat template")
    return HFTokenizer(tok._tok, template, tok.eos_token_ids, tok._bos, tok._pad)


def load_tokenizer_file(path: Path, eos: tuple[int, ...]) -> HFTokenizer:
    """`--tokenizer`: a tokenizer.json (no chat template; `eos` stays the model's), the
    tokenizer of a .gguf file (its own template and end-of-sequence id)."""
    if path.suffix == ".gguf":
        return _gguf_tokenizer(path)
    from tokenizers import Tokenizer as RawTokenizer

    return HFTokenizer(RawTokenizer.from_file(str(path)), None, eos, "")


def gguf_tokenizer_json(path: Path) -> str:
    """The tokenizer of a .gguf file as tokenizer.json text (a few MB, without the weights)."""
    return str(_gguf_tokenizer(path)._tok.to_str())


def gguf_tokenizer_folder(path: Path, out: Path) -> None:
    """The tokenizer of a .gguf file as a folder transformers loads whole: tokenizer.json and
    tokenizer_config.json (its class, special tokens and chat template)."""
    tok = _gguf_tokenizer(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.tokenizer_json())
    config = {k: v for k, v in tok.hf_config().items() if v is not None}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
