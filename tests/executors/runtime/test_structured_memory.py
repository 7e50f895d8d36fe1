"""Constrained steps ask nothing of memory, on the CPU (the GPU's twin is in test_gpu.py): a
random model with SmolLM2's tokenizer serves requests of which half carry a JSON schema, every
step's live bytes stay those of the first with no leak report, and each constrained text
validates; a constrained step that keeps a tensor per row (planted) is caught."""

from __future__ import annotations

import numpy as np
import torch
from half_schemas import check_constrained, half_schemas

from memstep.core.config import EngineConfig
from memstep.core.model_source import shipped_gguf_path
from memstep.events.types import LeakSuspected, StepFinished, is_leak
from memstep.executors.process.inprocess import local_engine
from memstep.executors.runtime import sampler as sampler_module

GRID = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "grid": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "maxItems": 4,
        },
    },
    "required": ["color", "grid"],
    "additionalProperties": False,
}


def _serve(num: int = 8) -> tuple[list, list]:
    """(completions, records) of `num` requests, the odd ones with the schema."""
    cfg = EngineConfig(
        model="random:tiny",
        tokenizer=str(shipped_gguf_path()),
        max_num_seqs=8,
        max_model_len=256,
        num_kv_blocks=64,
    )
    records: list = []
    engine = local_engine(cfg, sinks=[records.append])
    try:
        done = engine.generate(*half_schemas(num, GRID, 60))
    finally:
        engine.shutdown()
    return done, records


def _live(records: list) -> set[int]:
    return {r.memory.live_bytes for r in records if isinstance(r, StepFinished)}


def test_constrained_steps_keep_live_bytes_flat_and_validate():
    done, records = _serve()
    check_constrained(done, GRID)
    assert sum(isinstance(r, StepFinished) for r in records) > 10
    assert len(_live(records)) == 1, _live(records)
    assert [r for r in records if is_leak(r)] == []


def test_a_constrained_step_that_keeps_tensors_is_caught(monkeypatch):
    kept: list[torch.Tensor] = []
    plain = sampler_module.mask_row

    def keeping(logits: np.ndarray, words: np.ndarray, bias: np.ndarray) -> None:
        kept.append(torch.from_numpy(bias.copy()))  # a leak: one row's biases per step
        plain(logits, words, bias)

    monkeypatch.setattr(sampler_module, "mask_row", keeping)
    _, records = _serve()
    assert kept and len(_live(records)) > 1
    assert any(r.what == "live_growth" for r in records if isinstance(r, LeakSuspected))
