"""The fused mixture-of-experts path (executors/cuda/kernels/fused_moe.py) against the torch
loop (`layers/mlp.py`'s `mixture`), its Triton kernels interpreted on the CPU (tests/conftest.py
sets TRITON_INTERPRET=1 before anything imports triton)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from memstep.executors.cuda.kernels import triton_available  # noqa: E402
from memstep.executors.cuda.kernels.fused_moe import (  # noqa: E402
    experts_hit,
    fused_moe,
    sort_by_expert,
    tile_height,
)
from memstep.executors.model.layers.block import Experts  # noqa: E402
from memstep.executors.model.layers.mlp import mixture  # noqa: E402

pytestmark = pytest.mark.skipif(
    not triton_available(), reason="needs CUDA, or TRITON_INTERPRET=1 (tests/conftest.py)"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_experts(num_experts=8, hidden=32, width=24, top_k=2, normalize=True) -> Experts:
    gen = torch.Generator().manual_seed(num_experts + top_k)

    def noise(*shape):
        return (0.2 * torch.randn(*shape, generator=gen)).to(DEVICE)

    router, gate_up = noise(num_experts, hidden), noise(num_experts, 2 * width, hidden)
    return Experts(router, gate_up, noise(num_experts, hidden, width), top_k, normalize)


def test_sort_pads_each_experts_run_and_skips_experts_no_token_chose():
    chosen = torch.tensor([[3, 0], [3, 1], [0, 3]], device=DEVICE)  # experts 2, 4..7: none

    entries = sort_by_expert(chosen, 8, 4)

    # expert 0: entries 1, 4; expert 1: 3; expert 3: 0, 2, 5 -- each run padded to 4 rows
    pad = 6
    expected = [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]
    assert entries.rows[:12].tolist() == expected
    assert (entries.rows[12:] == pad).all()
    assert entries.block_experts[:3].tolist() == [0, 1, 3]
    assert (entries.block_experts[3:] == 8).all()  # tiles past the last run: none
    assert entries.counts.tolist() == [2, 1, 0, 3, 0, 0, 0, 0]


@pytest.mark.parametrize(
    "tokens, activation, normalize",
    [(3, "silu", True), (40, "gelu_tanh", False), (1, "silu", False)],
)
def test_fused_moe_matches_the_torch_loop(tokens, activation, normalize):
    """A decode's token (6 of 8 experts with no rows), 3 tokens, and 40 (a prefill's tile
    height): the grouped GEMMs give the torch loop's rows."""
    experts = tiny_experts(normalize=normalize)
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)

    out = fused_moe(x, experts, activation)

    expected = mixture(x, experts, activation)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert experts_hit(x, experts) <= min(8, 2 * tokens)


def test_a_wrong_top_k_does_not_match():
    """The planted mistake: routing each token to its top 1 instead of 2 changes the rows."""
    experts = tiny_experts()
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    wrong = Experts(experts.router, experts.gate_up, experts.down, 1, True)

    assert (fused_moe(x, wrong, "silu") - mixture(x, experts, "silu")).abs().max() > 1e-3


def test_tile_height_follows_entries_per_expert():
    assert tile_height(8 * 1, 128) == 16 and tile_height(8 * 4096, 128) == 64
