"""Tensor parallelism on two GPUs: NCCL all-reduces inside the captured decode graphs give the
tokens of one GPU, every rank's allocator stays flat after capture, and a killed rank is the
executor's death. CPU runs (and one-GPU machines) skip this module; on two GPUs:

    python -m pytest -q -m gpu tests/executors/process/test_tensor_parallel_gpu.py
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from memstep.cli.traffic import rising_waves
from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import ExecutorLost, is_leak
from memstep.executors.process.remote import ProcessExecutor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

BASE = EngineConfig(
    model="random:smollm2-135m",
    dtype="float32",
    device="cuda",
    seed=3,
    max_num_seqs=8,
    max_model_len=512,
    num_kv_blocks=512,
    max_num_batched_tokens=512,
)
PROMPTS: list[str | list[int]] = [[5, 17, 200, 3, 9], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _tokens(cfg: EngineConfig, sinks=()) -> list[list[int]]:
    engine = Engine(cfg, ProcessExecutor, sinks)
    try:
        assert engine.captured.graph_sizes, "decode graphs were captured"
        return [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    finally:
        engine.shutdown()


def test_graphs_with_nccl_all_reduces_give_one_gpu_s_tokens():
    # 9 query heads and 3 KV heads: 3 ranks would need 3 GPUs; random:tiny splits by 2
    cfg = BASE.replace(model="random:tiny")
    assert _tokens(cfg.replace(tensor_parallel_size=2)) == _tokens(cfg)


def test_every_rank_s_allocator_is_flat_after_capture():
    records: list[object] = []
    cfg = BASE.replace(model="random:tiny", dtype="bfloat16", tensor_parallel_size=2)
    engine = Engine(cfg, ProcessExecutor, [records.append])
    try:
        rising_waves(engine, 200, 8, seed=1)
    finally:
        engine.shutdown()
    assert not [r for r in records if is_leak(r)]


def test_a_killed_rank_is_the_executor_s_death_on_cuda():
    records: list[object] = []
    engine = Engine(BASE.replace(model="random:tiny", tensor_parallel_size=2), ProcessExecutor)
    engine.sinks.append(records.append)
    try:
        engine.add_request(
            [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        )
        engine.step()
        assert isinstance(engine.executor, ProcessExecutor)
        os.kill(engine.executor.ranks.pids[0], signal.SIGKILL)
        engine.run_until_idle()
    finally:
        engine.shutdown()
    (lost, *_) = [r for r in records if isinstance(r, ExecutorLost)]
    assert "rank 1" in lost.reason
