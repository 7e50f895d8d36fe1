"""Piecewise graphs of eager steps (executors/cuda/piecewise.py), their pieces run eagerly on
the CPU.

The pieces are CUDA's fused layers (Triton kernels), so without CUDA they run in Triton's
interpreter, which tests/conftest.py chooses before anything imports triton (see
test_kernels.py). Capture itself needs CUDA: test_gpu.py replays the captured graphs against
the eager forward.
"""

from __future__ import annotations

import pytest
import torch

from memstep.core.model_config import PRESETS
from memstep.core.model_source import resolve
from memstep.events.plan import SeqPlan
from memstep.executors.cuda.piecewise import PiecewiseRunner, bucket_sizes, piecewise_bytes
from memstep.executors.model import kv_cache
from memstep.executors.model.llama import LlamaModel
from memstep.executors.model.weights import load_weights
from memstep.executors.runtime.batch_builder import build_batch

pytest.importorskip("triton")
from memstep.executors.cuda.backend import CudaBackend  # noqa: E402
from memstep.executors.cuda.kernels import triton_available  # noqa: E402

pytestmark = pytest.mark.skipif(
    not triton_available(), reason="needs CUDA, or TRITON_INTERPRET=1 (tests/conftest.py)"
)
CPU = torch.device("cpu")
BLOCK = 4
PAGES = 40


def test_buckets_end_at_the_token_budget_and_steps_pad_to_the_next():
    assert bucket_sizes(512) == [16, 32, 64, 128, 192, 256, 384, 512]
    assert bucket_sizes(100) == [16, 32, 64, 100]
    assert bucket_sizes(8192)[-1] == 4096  # a step over it runs eagerly
    runner = PiecewiseRunner.__new__(PiecewiseRunner)
    runner.sizes = bucket_sizes(100)
    assert [runner.padded_size(n) for n in (1, 16, 17, 65, 100)] == [16, 16, 32, 100, 100]
    assert runner.can_run(100) and not runner.can_run(101) and not runner.can_run(0)


def tiny_model() -> LlamaModel:
    cfg = PRESETS["tiny"]
    weights = load_weights(resolve("random:tiny"), cfg, torch.float32, CPU)
    return LlamaModel(cfg, weights, max_positions=256, backend=CudaBackend())


def caches(model: LlamaModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg = model.cfg
    shape = (PAGES, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    return kv_cache.allocate(cfg.num_layers, shape, torch.float32, CPU)


def plan(name: str, start: int, tokens: list[int], pages: list[int]) -> tuple[SeqPlan, list[int]]:
    return SeqPlan(name, start, tokens, pages, True, 0, start + len(tokens)), tokens


def steps() -> list[list[tuple[SeqPlan, list[int]]]]:
    """Three prompts, then a mixed step: two of them decoding beside a new prompt and the
    third's next chunk."""
    a, b, c = [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12, 13]
    first = [plan("a", 0, list(range(3, 14)), a), plan("b", 0, list(range(20, 27)), b)]
    first.append(plan("c", 0, list(range(40, 48)), c))
    mixed = [plan("a", 11, [99], a), plan("b", 7, [98], b)]
    mixed += [plan("d", 0, list(range(60, 69)), [14, 15, 16]), plan("c", 8, [50, 51, 52, 53], c)]
    return [first, mixed]


def test_pieces_equal_the_fused_forward_and_padding_writes_no_kv():
    """Steps of 26 and 15 tokens padded to 32 and 16: the hidden states and every KV slot
    equal the eager fused forward's; slots no sequence owns stay untouched."""
    torch.manual_seed(0)
    model = tiny_model()
    ours, theirs = caches(model), caches(model)
    for cache in (*ours, *theirs):
        for part in cache:
            part.fill_(7.0)  # a slot written by padding would change
    runner = PiecewiseRunner(model, ours, max_tokens=64)
    for feeds in steps():
        batch, _ = build_batch(feeds, BLOCK, CPU, packed=True)
        assert runner.padded_size(batch.num_tokens) > batch.num_tokens
        got = runner.run(batch).clone()
        want = model.forward(batch, theirs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (k, v), (k_ref, v_ref) in zip(ours, theirs, strict=True):
        torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)
    untouched = ours[0][0][17:]  # pages past every sequence's
    assert torch.all(untouched == 7.0)
    assert runner.num_runs == 2


def test_a_lost_pad_slot_writes_padding_into_the_cache():
    """The check above fires: with padding given slot 0 instead of -1, padded rows write
    page 0 (sequence a's first tokens) and the caches no longer match."""
    model = tiny_model()
    ours, theirs = caches(model), caches(model)
    runner = PiecewiseRunner(model, ours, max_tokens=64)

    def pad_to_slot_zero(start: int, stop: int) -> None:
        runner.ids[start:stop].zero_()
        runner.positions[start:stop].zero_()
        runner.slots[start:stop].fill_(0)

    runner._pad = pad_to_slot_zero  # type: ignore[method-assign]
    for feeds in steps():
        batch, _ = build_batch(feeds, BLOCK, CPU, packed=True)
        runner.run(batch)
        model.forward(batch, theirs)
    assert not torch.equal(ours[0][0], theirs[0][0])


def test_the_plan_estimate_covers_the_static_buffers():
    model = tiny_model()
    runner = PiecewiseRunner(model, caches(model), max_tokens=64)
    assert runner.nbytes <= piecewise_bytes(64, model.cfg, 4)
