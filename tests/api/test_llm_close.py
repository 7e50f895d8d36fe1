"""Engines in one process: closing or deleting an `LLM` gives its memory back (every tensor it
made, and the host memory its KV cache took), so that a second `LLM` finds the process as the
first found it.  The CUDA half (reserved device memory, a second engine's plan) is in
tests/api/test_llm_close_gpu.py."""

from __future__ import annotations

import gc

import torch

from memstep import LLM, SamplingParams
from memstep.core.host_memory import MIB, rss_bytes

ARGS = {"dtype": "float32", "max_num_seqs": 4, "cpu_kv_cache_bytes": 192 * MIB}


def tensor_bytes() -> int:
    """Bytes of every distinct CPU tensor storage alive in this process (an engine freezes its
    start-up objects out of gc.get_objects(): they are brought back first)."""
    gc.unfreeze()
    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            s = obj.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def run(llm: LLM) -> None:
    out = llm.generate(["The capital of France is"] * 4, SamplingParams(max_tokens=8, seed=1))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


def test_closing_an_llm_gives_its_tensors_and_host_memory_back():
    with LLM("smollm2", **ARGS) as warm:  # loads the process's shared weight cache
        run(warm)
    assert warm.closed
    tensors, rss = tensor_bytes(), rss_bytes()
    with LLM("smollm2", **ARGS) as llm:
        for layer in llm.engine.executor.worker.kv:  # every KV page resident, as in serving
            layer[0].fill_(1.0), layer[1].fill_(1.0)
        del layer  # the test's own reference to the last layer's pages
        run(llm)
        held = tensor_bytes() - tensors
        assert held >= 150 * MIB, held  # its KV cache at least
    assert tensor_bytes() == tensors, "every tensor of the closed engine is gone"
    assert rss_bytes() - rss < 48 * MIB, (rss_bytes() - rss) / MIB


def test_deleting_an_llm_closes_it_and_a_second_one_serves():
    llm = LLM("random:tiny", **ARGS)
    run(llm)
    tensors = tensor_bytes()
    engine = llm.engine
    del llm
    assert engine.state == "shutdown" and engine.executor is None
    del engine
    assert tensor_bytes() < tensors
    with LLM("random:tiny", **ARGS) as second:
        run(second)
        second.close()  # twice: the second does nothing


def test_a_close_that_keeps_its_worker_is_caught(monkeypatch):
    """The check above, planted with a close that keeps the worker (a reference left behind):
    the tensors stay, and tensor_bytes() says so."""
    from memstep.api import llm as llm_module

    kept: list = []

    def leaky(engine) -> None:
        kept.append(engine.executor.worker)
        engine.shutdown()

    monkeypatch.setattr(llm_module, "_release", leaky)
    tensors = tensor_bytes()
    with LLM("random:tiny", **ARGS) as llm:
        run(llm)
    assert tensor_bytes() > tensors and kept
