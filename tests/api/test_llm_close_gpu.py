"""The CUDA half of engines in one process: two `LLM`s created and closed in turn leave the
device's reserved memory at its first value, and an engine made while another is open plans
around what the process already holds (its predicted peak counts it, its KV cache leaves it)."""

from __future__ import annotations

import gc

import pytest
import torch

from memstep import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ARGS = {"device": "cuda", "dtype": "bfloat16", "max_num_seqs": 8, "gpu_memory_utilization": 0.3}


def run(llm: LLM) -> None:
    out = llm.generate(["The capital of France is"] * 8, SamplingParams(max_tokens=16, seed=1))
    assert all(len(o.outputs[0].token_ids) == 16 for o in out)


def test_two_llms_in_turn_give_reserved_memory_back_to_its_first_value():
    with LLM("smollm2", **ARGS) as first:  # the process's one-time CUDA state (cuBLAS, streams)
        run(first)
    gc.collect()
    base = torch.cuda.memory_reserved()
    for _ in range(2):
        with LLM("smollm2", **ARGS) as llm:
            run(llm)
            assert torch.cuda.memory_reserved() > base + (256 << 20), "its KV cache at least"
        assert torch.cuda.memory_reserved() == base
    del llm
    assert torch.cuda.memory_reserved() == base


def test_a_second_open_engine_plans_around_the_first():
    """Each asks for 60% of the device: the second gets what the first left, not 60% more."""
    args = {**ARGS, "gpu_memory_utilization": 0.6}
    with LLM("smollm2", **args) as first:
        run(first)
        held = torch.cuda.memory_allocated()
        with LLM("smollm2", **args) as second:
            run(second)
            plan, alone = second.engine.memory_plan, first.engine.memory_plan
            assert plan.held_bytes == held > 0
            assert plan.predicted_peak_bytes >= held + plan.weights_bytes
            assert plan.num_kv_blocks < alone.num_kv_blocks  # the first's memory is not its own
            assert torch.cuda.max_memory_reserved() <= plan.predicted_peak_bytes * 1.05
