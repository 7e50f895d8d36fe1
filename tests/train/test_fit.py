"""The draft head's training loop (train/fit.py): which keys each unrolled pass reads, and which
rows count as predictions."""

from __future__ import annotations

import torch

from memstep.train.fit import from_answers, pass_masks, pass_terms


def test_pass_masks_read_the_true_pairs_then_the_chain():
    masks = pass_masks(5, 3, window=3, device="cpu")
    # pass 1 at 4: true pairs 2..4 (the window of 3); pass 3 at 4: true pairs 0..2, then the
    # chain's pass-2 key at 3 and its own at 4
    assert masks[0][4].tolist() == [False, False, True, True, True]
    third = masks[2][4].view(3, 5)
    assert third[0].tolist() == [True, True, True, False, False]
    assert third[1].tolist() == [False, False, False, True, False]
    assert third[2].tolist() == [False, False, False, False, True]


def test_training_counts_only_chains_that_start_in_the_answer():
    """Rows before an exchange's answer are prompt pairs to attend, never predictions: pass u at
    index i counts when its chain started at i - u, at or after the answer's first row (3)."""
    chosen, lengths, starts = torch.zeros(1, 10, dtype=torch.long), torch.tensor([10]), [3]
    feats, labels = torch.zeros(1, 10, 4), torch.zeros(8, dtype=torch.long)
    for u, first in ((0, 3), (2, 5)):
        valid, _, _ = pass_terms(feats, chosen, lengths, torch.tensor(starts), labels, u)
        assert valid[0].nonzero().flatten().tolist() == list(range(first, 9))
    data = ([torch.arange(10.0).unsqueeze(1)], [torch.arange(10)], [torch.arange(10)], starts)
    cut = from_answers(data)
    assert cut[0][0][0, 0] == 3.0 and cut[1][0].tolist() == list(range(3, 10)) and cut[3] == [0]
