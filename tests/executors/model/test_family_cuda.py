"""Every family through CUDA's layers (`executors/cuda/backend.py`), its Triton kernels run by
Triton's interpreter on the CPU (tests/conftest.py; compiled on a GPU), against the torch
reference backend over the same tiny checkpoint in float32: the piecewise graphs' pieces and
the decode graphs' forward (`DecodeForward`), run eagerly, past the windows. With these the
CUDA graphs stay on for every family (`-m gpu`: test_family_gpu.py)."""

from __future__ import annotations

import attrs
import pytest
import structlog
import torch
from tiny_families import FAMILIES, make_checkpoint

from memstep.core.model_config import PRESETS
from memstep.core.model_source import model_config, resolve
from memstep.events.plan import SeqPlan
from memstep.executors.model import kv_cache
from memstep.executors.model.llama import LlamaModel
from memstep.executors.model.torch_backend import TorchBackend
from memstep.executors.model.weights import load_weights
from memstep.executors.runtime.batch_builder import build_batch

pytest.importorskip("triton")
from memstep.executors.cuda.backend import CudaBackend  # noqa: E402
from memstep.executors.cuda.graph_runner import GraphRunner  # noqa: E402
from memstep.executors.cuda.kernels import paged_decode_attention, triton_available  # noqa: E402
from memstep.executors.cuda.piecewise import PiecewiseRunner  # noqa: E402

pytestmark = pytest.mark.skipif(
    not triton_available(), reason="needs CUDA, or TRITON_INTERPRET=1 (tests/conftest.py)"
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # kernels compiled there
BLOCK = 4


@pytest.fixture(scope="module", params=list(FAMILIES))
def twins(request, tmp_path_factory) -> tuple[LlamaModel, LlamaModel]:
    """The family's tiny checkpoint as two models over the same weights: torch's, CUDA's."""
    folder = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, folder)
    cfg = model_config(resolve(str(folder)))
    weights = load_weights(resolve(str(folder)), cfg, torch.float32, DEVICE)
    reference = LlamaModel(cfg, weights, 512, TorchBackend())
    return reference, LlamaModel(cfg, weights, 512, CudaBackend(paged_decode_attention))


def caches(model: LlamaModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (64, BLOCK, model.cfg.num_kv_heads, model.cfg.head_dim)
    return kv_cache.allocate(model.cfg.num_layers, shape, torch.float32, DEVICE)


def test_the_graphs_forwards_give_the_torch_layers_hidden_states(twins):
    check_graph_forwards(*twins)


def test_a_skipped_qk_norm_is_caught(twins, monkeypatch):
    """The planted mistake: CUDA's layers without their q/k norms no longer match."""
    reference, fused = twins
    if not reference.cfg.qk_norm:
        pytest.skip("the family has no q/k norms")
    from memstep.executors.cuda import kernels

    rotate = kernels.rope_and_write_kv
    monkeypatch.setattr(CudaBackend, "qk_norms", lambda *args: None)
    monkeypatch.setattr(kernels, "rope_and_write_kv", lambda *args: rotate(*args[:8]))
    with pytest.raises(AssertionError):
        check_graph_forwards(reference, fused)


def check_graph_forwards(reference: LlamaModel, fused: LlamaModel) -> None:
    """A prompt of 20 tokens and one of 9 (both past the windows) in a piecewise step (padded
    to 32), then both decoding in a decode-graph step: hidden states and KV as the torch
    layers'. These are the layers of the eager forward too (`CudaBackend.decoder`)."""
    ours, theirs = caches(fused), caches(reference)
    a, b = list(range(6)), list(range(6, 9))
    first = [(seq("a", 0, list(range(3, 23)), a)), seq("b", 0, list(range(50, 59)), b)]
    decode = [seq("a", 20, [7], a), seq("b", 9, [8], b)]
    pieces = PiecewiseRunner(fused, ours, max_tokens=32)
    graphs = GraphRunner(fused, ours, 4, 128, 0, BLOCK)
    with torch.inference_mode():
        batch, _ = build_batch(first, BLOCK, DEVICE, packed=True)
        torch.testing.assert_close(
            pieces.run(batch), reference.forward(batch, theirs), atol=1e-4, rtol=1e-4
        )
        hidden, _ = graphs.run(decode)
        batch, _ = build_batch(decode, BLOCK, DEVICE)
        want = reference.forward(batch, theirs)
    torch.testing.assert_close(hidden, want, atol=1e-4, rtol=1e-4)
    for (k, v), (k_ref, v_ref) in zip(ours, theirs, strict=True):
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)


def seq(name: str, start: int, tokens: list[int], pages: list[int]):
    return SeqPlan(name, start, tokens, pages, True, 0, start + len(tokens), {}), tokens


def test_the_load_says_what_a_family_runs_on_cuda():
    """Graphs on, and which pieces are torch ops inside them; nothing said for Llama."""
    from memstep.executors.cuda.backend import log_family_pieces

    phi = attrs.evolve(PRESETS["tiny"], architecture="phi3", rotary_dim=8)
    with structlog.testing.capture_logs() as logs:
        log_family_pieces(phi)
        log_family_pieces(PRESETS["tiny"])
    assert [e["event"] for e in logs] == [
        "backend cuda runs family phi3's partial rotary in its fused layers, so CUDA graphs "
        "stay on; torch ops inside them: partial rotary"
    ]
