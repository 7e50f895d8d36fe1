"""The leak corpus's CUDA half (`pytest -m gpu`): every clean shape silent and every planted
leak caught on a GPU, fragmentation (refused on the CPU) among them, where device figures are
the caching allocator's own.  On SmolLM2 (its EAGLE head for the speculation cases) where its
GGUF is installed, else on random:tiny, as the CPU half runs (speculation there by ngram)."""

from __future__ import annotations

import pytest
import torch

from memstep.cli import corpus
from memstep.cli.corpus_cases import CASES
from memstep.core.model_source import ModelError, shipped_gguf_path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_the_cuda_corpus_is_silent_on_clean_traffic_and_catches_every_plant():
    model = "smollm2" if _has_smollm2() else "random:tiny"
    outcomes = corpus.run_corpus(CASES, model=model, device="cuda")
    table = corpus.format_outcomes(outcomes)
    print("\n" + table)
    assert len(outcomes) == len(CASES), "the CUDA half runs every case, fragmentation included"
    for o in outcomes:
        want = "ok" if o.case.expect is None else "caught"
        assert o.verdict == want, f"{o.case.name}: {o.verdict}\n{table}"
    fragmentation = next(o for o in outcomes if o.case.plant == "fragmenting_scratch")
    assert fragmentation.leaks[0].what == "fragmentation"
    again = [corpus.rejudge(o) for o in outcomes]
    assert [o.verdict for o in again] == [o.verdict for o in outcomes]


def _has_smollm2() -> bool:
    try:
        return shipped_gguf_path().is_file()
    except ModelError:  # the model's package is not installed
        return False
