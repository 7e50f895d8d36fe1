"""A token bitmask (bit t of int32 word t // 32 allows token t, as llguidance writes it)
applied to a row of logits on the CPU, and the bit values the GPU's ops test words against.

On the CPU the mask is never unpacked: each byte of it is looked up in a 256-entry table of 8
additive biases (0 or -inf) and added to the logits, in numpy on the calling thread (a torch op
there would wake torch's thread pool, which the forward pass's kernels share), without a branch
per token; a row whose mask allows every token is skipped.
"""

from __future__ import annotations

import numpy as np
import torch


def bit_values() -> torch.Tensor:
    """Bit i of an int32 word for i in 0..31 (bit 31 is the sign)."""
    return torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


# each byte of a bitmask as the additive biases of its 8 tokens: 0 (allowed) or -inf: [256, 8]
BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
    np.float32(0.0),
    np.float32(-np.inf),
).astype(np.float32)


def mask_row(logits: np.ndarray, words: np.ndarray, bias: np.ndarray) -> None:
    """-inf where the bitmask `words` ([W] int32) forbids a token of `logits` ([V] float32), in
    place, branch-free: the bitmask's bytes looked up in `BYTE_BIAS` into `bias` (float32, at
    least 32 W: a buffer of the caller's), added to the logits. A row that allows every token
    (free text inside a JSON string, mostly) is left as it is."""
    vocab = logits.shape[0]
    if allows_all(words, vocab):
        return
    spread = bias[: words.size * 32]
    np.take(BYTE_BIAS, words.view(np.uint8), axis=0, out=spread.reshape(-1, 8))
    np.add(logits, spread[:vocab], out=logits)


def allows_all(words: np.ndarray, vocab: int) -> bool:
    """Whether the bitmask `words` allows each of the `vocab` tokens (bits past it ignored)."""
    full, rest = divmod(vocab, 32)
    if not bool((words[:full] == -1).all()):
        return False
    low = (1 << rest) - 1
    return rest == 0 or int(words[full]) & low == low
