"""The one place that assembles an executor: for a config and its device, the model's compute
backend (CUDA's Triton kernels or the CPU's C kernels), the CUDA graphs, the EAGLE head and the
speculative decoder, handed to the worker (`executors/runtime/parts.py`), which imports none of
cuda/ or spec/."""

from __future__ import annotations

import structlog
import torch

from memstep.core.config import EngineConfig
from memstep.core.model_config import ModelConfig
from memstep.events.plan import MemoryPlan, PhaseFigures
from memstep.executors.model.kv_cache import KvCaches
from memstep.executors.model.llama import Backend, LlamaModel
from memstep.executors.model.rank_group import RankGroup
from memstep.executors.model.weights import Weights
from memstep.executors.runtime.parts import Forward, Head, StepDecoder
from memstep.executors.runtime.runner import Runner
from memstep.executors.runtime.running_requests import RunningRequests
from memstep.executors.runtime.sampler import Sampler
from memstep.executors.runtime.worker import Worker
from memstep.executors.spec import eagle
from memstep.states.kinds import Spec
from memstep.states.startup import Capture

log = structlog.get_logger("memstep.executor")

# What capture reserves beyond the decode path's own bytes whatever the batch (the capture
# stream's cuBLAS workspace and the pool's 2 MiB pages are the candidates; measured:
# docs/benchmarks.md, "Figures behind the code's constants")
CAPTURE_MARGIN = 64 << 20


def build_worker(cfg: EngineConfig, max_model_len: int, ranks: RankGroup | None = None) -> Worker:
    """An executor rank's worker, with the parts its config and device take."""
    return Worker(cfg, max_model_len, ranks, parts=Assembly())


def pick_backend(
    device: torch.device,
    cfg: ModelConfig,
    weights: Weights,
    kv_dtype: torch.dtype,
    one_rank: bool = True,
    bf16_products: bool = False,
    decode_attention: bool = True,
) -> Backend:
    """CUDA's Triton kernels on a GPU, the CPU's C kernels (where they apply) on the CPU.
    `decode_attention=False`: torch's attention for decode rows too (a draft model)."""
    if device.type == "cuda":  # imports Triton: never on a CPU-only path
        from memstep.executors.cuda.backend import CudaBackend, log_family_pieces
        from memstep.executors.cuda.kernels import paged_decode_attention

        log_family_pieces(cfg)
        return CudaBackend(paged_decode_attention if decode_attention else None, one_rank)
    from memstep.executors.cpu.backend import CpuBackend

    return CpuBackend.choose(cfg, weights, kv_dtype, one_rank, bf16_products, decode_attention)


class Assembly:
    """`ExecutorParts` for any config: each part decided by the device of what it is given."""

    def backend(
        self,
        device: torch.device,
        model_cfg: ModelConfig,
        weights: Weights,
        kv_dtype: torch.dtype,
        one_rank: bool,
        bf16_products: bool,
    ) -> Backend:
        return pick_backend(device, model_cfg, weights, kv_dtype, one_rank, bf16_products)

    def graph_bytes(
        self,
        cfg: EngineConfig,
        model_cfg: ModelConfig,
        blocks_per_seq: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> int:
        if device.type != "cuda":
            return 0
        from memstep.executors.cuda.decode import static_bytes
        from memstep.executors.cuda.piecewise import piecewise_bytes

        dtype_bytes = torch.empty((), dtype=dtype).element_size()
        graphs = static_bytes(
            cfg.max_num_seqs, blocks_per_seq, cfg.block_size, model_cfg, dtype_bytes
        )
        if cfg.cuda_graphs and cfg.piecewise_graphs and cfg.tensor_parallel_size == 1:
            graphs += piecewise_bytes(cfg.max_num_batched_tokens, model_cfg, dtype_bytes)
        return graphs + CAPTURE_MARGIN

    def capture(
        self,
        cfg: EngineConfig,
        model: LlamaModel,
        kv: KvCaches,
        sampler: Sampler,
        max_len: int,
        capture: Capture,
        memory_plan: MemoryPlan | None,
    ) -> tuple[Runner, PhaseFigures] | None:
        device = model.w["embed"].device
        if device.type != "cuda":  # every family's layers run in the graphs there
            return None
        from memstep.executors.cuda.graph_runner import capture_phase, peak_figures, with_peaks

        hidden = capture.dummy_hidden
        runner, figures = capture_phase(cfg, model, kv, sampler, max_len, hidden)
        figures = with_peaks(figures, device, memory_plan)
        log.info("memory after capture", **peak_figures(figures))
        return runner, figures

    def draft_context(self, cfg: EngineConfig) -> int:
        return eagle.draft_context(cfg)

    def eagle_head(self, cfg: EngineConfig, model: LlamaModel) -> Head | None:
        from memstep.executors.spec.decoder import eagle_head

        return eagle_head(cfg, model)

    def spec_decoder(
        self,
        cfg: EngineConfig,
        model: LlamaModel,
        forward: Forward,
        requests: RunningRequests,
        sampler: Sampler,
        spec: Spec,
        head: Head | None,
        kv: KvCaches,
        weights: Weights,
        dtype: torch.dtype,
        max_len: int,
    ) -> StepDecoder:
        from memstep.executors.spec.decoder import SpecDecoder, draft_model
        from memstep.executors.spec.eagle_head import EagleHead

        device = model.w["embed"].device
        draft = draft_model(cfg, model.cfg, weights, dtype, device, max_len, pick_backend)
        assert head is None or isinstance(head, EagleHead)
        return SpecDecoder(cfg, model, forward, requests, sampler, spec, draft, head, kv)
