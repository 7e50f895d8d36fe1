"""EAGLE on CUDA against the CPU, the same SmolLM2 and committed head: the hidden states the head
is given to draft from, and the share of its drafts accepted, through each CUDA path (eager,
decode graphs, the piecewise graphs and the decode step replayed ahead as shipped, and those
with the automatic threshold on, so that `no_spec` probes run with decode-ahead and spec is
re-entered after each). CUDA accepted 0.07 of the drafts where the CPU accepted a third
(issue 60). CPU runs skip this module; on a GPU machine:

    python -m pytest -q -m gpu tests/executors/spec/test_eagle_gpu.py
"""

from __future__ import annotations

import gc

import pytest
import torch

from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import StepFinished
from memstep.executors.process.inprocess import local_engine
from memstep.executors.spec.eagle_head import EagleHead

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CHATS = [
    "Write a short story about a dragon who learns to bake bread.",
    "Explain how vaccines train the immune system.",
]
PATHS = {
    "eager": {"cuda_graphs": False, "piecewise_graphs": False, "decode_ahead": False},
    "graphs": {"cuda_graphs": True, "piecewise_graphs": False, "decode_ahead": False},
    "shipped": {"cuda_graphs": True, "piecewise_graphs": True, "decode_ahead": True},
}


class Drafted:
    """What one run's head was given at each draft call (hidden states as float32 on the host,
    last tokens, pairs read), and its steps."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, list[int], list[int]]] = []
        self.steps: list[StepFinished] = []

    def keep(self, record: object) -> None:
        if isinstance(record, StepFinished):
            self.steps.append(record)

    @property
    def acceptance(self) -> float:
        spec = [s for s in self.steps if s.kind == "spec"]
        return sum(s.num_accepted for s in spec) / max(1, sum(s.num_proposed for s in spec))


def eagle_run(monkeypatch, device: str, dtype: str, auto: bool = False, **paths) -> Drafted:
    """Each chat alone (one stream), 64 greedy tokens, K = 2 at every spec step (adaptive K
    off; the automatic threshold where `auto`), prefix caching off."""
    seen = Drafted()
    draft_rows = EagleHead.draft_rows

    def spy(self, hidden, tokens, k, context, rows, counts):
        seen.calls.append((hidden.float().cpu(), tokens.tolist(), list(counts)))
        return draft_rows(self, hidden, tokens, k, context, rows, counts)

    monkeypatch.setattr(EagleHead, "draft_rows", spy)
    cfg = EngineConfig(
        model="smollm2",
        device=device,
        dtype=dtype,
        quantization="none",
        speculative_method="eagle",
        num_speculative_tokens=2,
        speculative_adaptive_k=False,
        speculative_auto_disable=auto,
        enable_prefix_caching=False,
        max_num_seqs=4,
        gpu_memory_utilization=0.2,
        **paths,
    )
    engine = local_engine(cfg, sinks=[seen.keep])
    try:
        tok = engine.tokenizer
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        for chat in CHATS:
            engine.generate([tok.encode_chat([{"role": "user", "content": chat}])], params)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    monkeypatch.setattr(EagleHead, "draft_rows", draft_rows)
    return seen


@pytest.fixture(scope="module")
def on_cpu():
    with pytest.MonkeyPatch.context() as mp:
        return eagle_run(mp, "cpu", "float32")


@pytest.fixture(scope="module")
def on_cpu_auto():
    with pytest.MonkeyPatch.context() as mp:
        return eagle_run(mp, "cpu", "float32", auto=True)


def same_calls(a: Drafted, b: Drafted) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The two runs' hidden states of the draft calls in order, while both drafted after the
    same token with the same pairs read (their texts agree so far)."""
    pairs = []
    for (ha, ta, ca), (hb, tb, cb) in zip(a.calls, b.calls, strict=False):
        if ta != tb or ca != cb:
            break
        pairs.append((ha, hb))
    return pairs


def close_acceptance(cuda: Drafted, cpu: Drafted, what: str, at_least: bool = False) -> None:
    """CUDA's share of drafts accepted within 10% of the CPU's (`at_least`: not under 90%)."""
    assert cpu.acceptance > 0.15, f"the CPU reference: {cpu.acceptance:.3f}"
    assert not any(torch.isnan(h).any() for h, _, _ in cuda.calls)
    low = cuda.acceptance >= 0.9 * cpu.acceptance
    assert low if at_least else abs(cuda.acceptance - cpu.acceptance) <= 0.1 * cpu.acceptance, (
        f"{what}: CUDA {cuda.acceptance:.3f}, CPU {cpu.acceptance:.3f}"
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("path", list(PATHS))
def test_the_head_gets_the_cpus_hidden_states_and_accepts_as_much(path, dtype, on_cpu, monkeypatch):
    """Every step spec: along the text both runs share, the states the head drafts from within
    float32's rounding of the CPU's (cosine), or bfloat16's; the share of drafts accepted within
    10% of the CPU's."""
    cuda = eagle_run(monkeypatch, "cuda", dtype, **PATHS[path])
    pairs = same_calls(on_cpu, cuda)
    assert len(pairs) >= 8, f"{len(pairs)} draft calls before the texts part"
    worst = min(float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()) for a, b in pairs)
    assert worst > (0.999 if dtype == "float32" else 0.98), f"cosine {worst:.4f}"
    close_acceptance(cuda, on_cpu, f"{path} {dtype}")


def test_with_probes_and_decode_ahead_the_head_accepts_as_on_the_cpu(on_cpu_auto, monkeypatch):
    """The automatic threshold on (its no_spec probes replay decode steps ahead, then spec is
    re-entered with a fresh state): bfloat16 as shipped against the CPU's run with it on.  The
    probes come where each device's measured costs put them, so the two runs draft over
    different stretches of text: CUDA must accept no less than 90% of the CPU's share (an H100
    accepted more), which is what the gap this guards was."""
    cuda = eagle_run(monkeypatch, "cuda", "bfloat16", auto=True, **PATHS["shipped"])
    assert any(s.kind == "no_spec" for s in cuda.steps), "probes ran"
    close_acceptance(cuda, on_cpu_auto, "probes, bfloat16", at_least=True)
