"""Output text grown a few tokens at a time, without decoding the whole output every step.

Decoding a request's full output after each step costs O(length) per token; this decodes only a
short window: the tokens already shown (`prefix`) and the new ones after them.  Text is released
once it no longer ends in U+FFFD (a UTF-8 character split across tokens); the last call of a
request releases whatever is left.  The concatenated pieces equal `decode(all output tokens)` for
byte-level BPE and byte tokenizers (tests/core/test_detokenizer.py).

One decode a call: the window's start stays put while it is short, so the text of the tokens
already shown is the previous call's decode; it moves `WINDOW` tokens behind the read position
once the window is twice that long, and only then is the shown part decoded on its own.

`ByteText` does the same without a decoder call where every id stands for fixed bytes (byte-level
BPE as GPT-2, Llama 3 and SmolLM2 have, and the byte tokenizer): the new tokens' bytes are
joined and decoded up to the last whole character; the start of a character that the next token
may complete waits for it. Its pieces add up to the same text (a lead byte always begins a
character in UTF-8, so decoding in parts cut before one reads as decoding the whole).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

WINDOW = 6  # tokens before the new ones that are decoded with them, for merge context (at least)


def output_text(
    decode: Callable[[list[int]], str], token_bytes: Sequence[bytes] | None
) -> IncrementalText | ByteText:
    """A request's output text, empty: `ByteText` where every id stands for fixed bytes."""
    return IncrementalText(decode) if token_bytes is None else ByteText(token_bytes)


class IncrementalText:
    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.text = ""
        self._prefix = 0  # first token of the decoded window
        self._read = 0  # tokens whose text is already in `text`
        self._shown = ""  # decode(ids[_prefix:_read])

    def extend(self, ids: list[int], final: bool = False) -> str:
        """`ids` is the whole output so far; returns the text that the new tokens add."""
        if len(ids) <= self._read and not final:
            return ""
        full = self._decode(ids[self._prefix :])
        if full.endswith("\ufffd") and not final:
            return ""  # an unfinished character: wait for the token that completes it
        shown = self._shown
        # a window that reads differently on its own falls back to the whole output, once
        in_context = full.startswith(shown)
        piece = full[len(shown) :] if in_context else self._decode(ids)[len(self.text) :]
        self.text += piece
        self._read = len(ids)
        if self._read - self._prefix > 2 * WINDOW:
            self._prefix = self._read - WINDOW
            self._shown = self._decode(ids[self._prefix : self._read])
        else:
            self._shown = full
        return piece


class ByteText:
    """As `IncrementalText`, for a tokenizer whose ids are fixed bytes (`token_bytes()`)."""

    def __init__(self, token_bytes: Sequence[bytes]):
        self._bytes = token_bytes
        self._pieces: list[str] = []
        self._held = b""  # the start of a character that the next token may complete
        self._read = 0  # tokens whose bytes are in `_pieces` or `_held`

    @property
    def text(self) -> str:
        """The text released so far (joined when asked for: most requests never ask)."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def extend(self, ids: list[int], final: bool = False) -> str:
        """`ids` is the whole output so far; returns the text that the new tokens add."""
        read = self._read
        if len(ids) == read + 1:
            data = self._held + self._bytes[ids[read]]
        else:
            data = self._held + b"".join(map(self._bytes.__getitem__, ids[read:]))
        self._read = len(ids)
        cut = len(data) if final else whole_characters(data)
        self._held = data[cut:]
        if not cut:
            return ""
        piece = (data if cut == len(data) else data[:cut]).decode(errors="replace")
        self._pieces.append(piece)
        return piece


# a UTF-8 character's length by its first byte (continuation bytes, 0x80-0xbf, begin none)
CHAR_LENGTH = bytes([1] * 0xC0 + [2] * 32 + [3] * 16 + [4] * 8 + [1] * 8)


def whole_characters(data: bytes) -> int:
    """Where a character that `data` ends inside of begins (its bytes so far are fewer than its
    first byte says); `len(data)` when it ends on a character's end, or on bytes no later byte
    can make whole."""
    n = len(data)
    for back in range(1, min(4, n + 1)):
        byte = data[n - back]
        if byte & 0xC0 != 0x80:  # the last character's first byte
            return n - back if CHAR_LENGTH[byte] > back else n
    return n
