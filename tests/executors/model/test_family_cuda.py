"""Every family through CUDA's layers (`executors/cuda/backend.py`), its Triton kernels run by
Triton's interpreter on the CPU (tests/conftest.py), against the torch reference backend over
the same tiny checkpoint in float32: the decoder (prefill chunks and decode rows, past the
windows), the decode graphs' forward (`DecodeForward`, run eagerly) and the piecewise graphs'
pieces. With these the CUDA graphs stay on for every family (`-m gpu`: test_family_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from tiny_families import FAMILIES, make_checkpoint, memstep_logits, prompts

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
CPU = torch.device("cpu")
BLOCK = 4


@pytest.fixture(scope="module", params=list(FAMILIES))
def twins(request, tmp_path_factory) -> tuple[LlamaModel, LlamaModel]:
    """The family's tiny checkpoint as two models over the same weights: torch's, CUDA's."""
    folder = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, folder)
    cfg = model_config(resolve(str(folder)))
    weights = load_weights(resolve(str(folder)), cfg, torch.float32, CPU)
    reference = LlamaModel(cfg, weights, 512, TorchBackend())
    return reference, LlamaModel(cfg, weights, 512, CudaBackend(paged_decode_attention))


def caches(model: LlamaModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (64, BLOCK, model.cfg.num_kv_heads, model.cfg.head_dim)
    return kv_cache.allocate(model.cfg.num_layers, shape, torch.float32, CPU)


def test_the_fused_layers_give_the_torch_layers_logits(twins):
    """A prompt past the windows in 16-token chunks, its last 3 tokens as decode rows: the
    same logits."""
    reference, fused = twins
    prompt = prompts()[-1]
    want = memstep_logits(reference, caches(reference), prompt, decoded=3)
    got = memstep_logits(fused, caches(fused), prompt, decoded=3)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_graphs_forwards_give_the_torch_layers_hidden_states(twins):
    """A prompt of 40 tokens and one of 9 in a piecewise step (padded to 64), then both
    decoding in a decode-graph step: hidden states and KV as the torch layers'."""
    reference, fused = twins
    ours, theirs = caches(fused), caches(reference)
    a, b = list(range(11)), list(range(11, 14))
    first = [(seq("a", 0, list(range(3, 43)), a)), seq("b", 0, list(range(50, 59)), b)]
    decode = [seq("a", 40, [7], a), seq("b", 9, [8], b)]
    pieces = PiecewiseRunner(fused, ours, max_tokens=64)
    graphs = GraphRunner(fused, ours, 4, 128, 0, BLOCK)
    with torch.inference_mode():
        batch, _ = build_batch(first, BLOCK, CPU, packed=True)
        torch.testing.assert_close(
            pieces.run(batch), reference.forward(batch, theirs), atol=1e-4, rtol=1e-4
        )
        hidden, _ = graphs.run(decode)
        batch, _ = build_batch(decode, BLOCK, CPU)
        want = reference.forward(batch, theirs)
    torch.testing.assert_close(hidden, want, atol=1e-4, rtol=1e-4)
    for (k, v), (k_ref, v_ref) in zip(ours, theirs, strict=True):
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)


def seq(name: str, start: int, tokens: list[int], pages: list[int]):
    return SeqPlan(name, start, tokens, pages, True, 0, start + len(tokens), {}), tokens
