"""Output text grown a few tokens at a time, without decoding the whole output every step.

Decoding a request's full output after each step costs O(length) per token; this decodes only a
short window: the tokens already shown (`prefix`) and the new ones after them.  Text is released
once it no longer ends in U+FFFD (a UTF-8 character split across tokens); the last call of a
request releases whatever is left.  The concatenated pieces equal `decode(all output tokens)` for
byte-level BPE and byte tokenizers (tests/core/test_detokenizer.py).

One decode a call: the window's start stays put while it is short, so the text of the tokens
already shown is the previous call's decode; it moves `WINDOW` tokens behind the read position
once the window is twice that long, and only then is the shown part decoded on its own.
"""

from __future__ import annotations

from collections.abc import Callable

WINDOW = 6  # tokens before the new ones that are decoded with them, for merge context (at least)


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
