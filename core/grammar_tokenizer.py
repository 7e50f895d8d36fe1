"""The grammar engine's (llguidance's) view of a model's tokenizer: what the executor's matchers
compile against (executors/runtime/guide.py), and the core's check workers too
(core/grammar_check.py), so that a check times the compile the executor will make.  No torch.
"""

from __future__ import annotations

from typing import Any

from memstep.core.model_source import ModelSource
from memstep.core.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def ll_tokenizer(source: ModelSource, vocab_size: int, eos: tuple[int, ...]) -> Any:
    """llguidance's tokenizer for the model: from the tokenizer.json of a Hugging Face tokenizer
    (the GGUF's own included), or from the byte table of a random model's byte tokenizer."""
    from llguidance import LLTokenizer, TokenizerWrapper

    tok = load_tokenizer(source, vocab_size, eos)
    eos_ids = list(eos or tok.eos_token_ids)
    if isinstance(tok, HFTokenizer):
        ends = grammar_ends(tok, eos_ids)
        return LLTokenizer(tok.tokenizer_json(), n_vocab=vocab_size, eos_token=ends)
    assert isinstance(tok, ByteTokenizer)
    return LLTokenizer(TokenizerWrapper(_ByteView(tok, eos_ids[0])), n_vocab=vocab_size)


END_TEXTS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>")


def grammar_ends(tok: HFTokenizer, eos_ids: list[int]) -> list[int]:
    """The end tokens llguidance is given: the model's that the tokenizer holds.  A random
    model with another model's tokenizer (`random:llama-3.1-8b --tokenizer` SmolLM2's) has none
    there: it gets the tokenizer's own end of text, which each mask swaps for the model's
    (`Guide.open_dead_end`), so a finished grammar stops the request."""
    held = [i for i in eos_ids if i < tok.vocab_size]
    if held:
        return held
    own = [tok.token_id(text) for text in END_TEXTS]
    return [next((i for i in own if i is not None), 0)]


class _ByteView:
    """A byte tokenizer as llguidance's TokenizerWrapper reads one."""

    def __init__(self, tok: ByteTokenizer, eos: int):
        self.tok = tok
        self.eos_token_id = eos
        self.bos_token_id = None
        self.tokens = tok.token_bytes()
        self.special_token_ids = [eos]

    def __call__(self, text: bytes) -> list[int]:
        return self.tok.encode(text.decode("utf-8", errors="replace"))
