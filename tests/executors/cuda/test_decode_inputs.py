"""`DecodeInputs`: the decode graphs' rows, one per fed token. A verify step's feed (its token
and its drafts) becomes rows at consecutive positions of its sequence, each attending up to its
own position; on the CPU the buffers are plain tensors, so the layout is checked here."""

from __future__ import annotations

import torch

from memstep.events.plan import SeqPlan
from memstep.executors.cuda.decode import DecodeInputs

BLOCK = 4


def feed(rid: str, start: int, tokens: list[int], table: list[int]):
    return SeqPlan(rid, start, tokens, table, True, 0, start + len(tokens)), tokens


def inputs() -> DecodeInputs:
    return DecodeInputs(max_seqs=8, max_blocks=3, block_size=BLOCK, device=torch.device("cpu"))


def test_a_verify_feed_is_a_row_per_token_at_consecutive_positions():
    buf = inputs()
    # a: a decode at position 5 (page 7); b: a token and two drafts at 2..4 (pages 1, 6)
    feeds = [feed("a", 5, [11], [3, 7]), feed("b", 2, [21, 22, 23], [1, 6])]
    assert buf.fits(feeds, max_tokens=3) and not buf.fits(feeds, max_tokens=2)

    buf.fill(feeds, 8)

    assert buf.ids.tolist() == [11, 21, 22, 23, 0, 0, 0, 0]
    assert buf.positions.tolist() == [5, 2, 3, 4, 0, 0, 0, 0]
    assert buf.slots.tolist() == [29, 6, 7, 24, -1, -1, -1, -1]  # page 6, slot 0: 24
    assert buf.seq_lens.tolist() == [6, 3, 4, 5, 0, 0, 0, 0]  # causal within the feed
    tables = buf.block_tables[:4, :2].tolist()
    assert tables == [[3, 7], [1, 6], [1, 6], [1, 6]]


def test_rows_past_the_buffers_or_a_context_past_the_tables_do_not_fit():
    buf = inputs()
    three = [feed(f"r{i}", 0, [1, 2, 3], [i]) for i in range(3)]
    assert not buf.fits(three, max_tokens=3)  # 9 rows, 8 in the buffers
    assert buf.fits(three[:2], max_tokens=3)
    width = 3 * BLOCK
    assert buf.fits([feed("a", width - 2, [1, 2], [0, 1, 2])], max_tokens=2)
    assert not buf.fits([feed("a", width - 1, [1, 2], [0, 1, 2])], max_tokens=2)
    assert not buf.fits([], max_tokens=2)
    assert not buf.fits([feed("a", 0, [], [0])], max_tokens=2)
