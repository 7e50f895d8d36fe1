"""Logs recorded once per session: the real model with speculative toggling, and a tiny one."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from replay_helpers import Workload, record

from memstep.core.config import EngineConfig

# Waves of requests; a wave comes when the previous one is down to two live requests, so the
# batch crosses speculative_disable_by_batch_size both ways many times.
WAVES = [20, 3, 24, 2, 1, 22, 3, 20, 2, 25, 3, 20, 1, 22, 2, 20, 3, 18]
SPEC = dict(
    speculative_method="ngram", num_speculative_tokens=3, speculative_disable_by_batch_size=4
)


@attrs.frozen
class RecordedLog:
    path: Path
    cfg: EngineConfig
    workload: Workload


@pytest.fixture(scope="session")
def smol_log(tmp_path_factory) -> RecordedLog:
    """SmolLM2-135M, 16 sequences, n-gram speculation below 4 running requests, 211 requests."""
    cfg = EngineConfig(model="smollm2", num_threads=1, **SPEC)
    path = tmp_path_factory.mktemp("smol") / "run.memlog"
    return RecordedLog(path, cfg, record(path, cfg, WAVES))


@pytest.fixture(scope="session")
def leak_log(tmp_path_factory) -> RecordedLog:
    """SmolLM2 with the speculative worker's incident planted: hidden states kept on the
    no-spec path (taken when the batch reaches 4) and never given back, for 40 steps and more:
    long enough for the detector to tell the slope from a step."""
    cfg = EngineConfig(
        model="smollm2", num_threads=1, debug_plant_leak="no_spec_hidden_states", **SPEC
    )
    path = tmp_path_factory.mktemp("leak") / "run.memlog"
    return RecordedLog(path, cfg, record(path, cfg, [8, 2], max_tokens=(40, 48), abort_every=100))


@pytest.fixture(scope="session")
def tiny_log(tmp_path_factory) -> RecordedLog:
    """The tiny random model, 8 sequences, the same speculative toggling, 42 requests."""
    cfg = EngineConfig(model="random:tiny", max_num_seqs=8, num_threads=1, **SPEC)
    path = tmp_path_factory.mktemp("tiny") / "run.memlog"
    return RecordedLog(path, cfg, record(path, cfg, [10, 2, 12, 3, 1, 14], abort_every=7))


@attrs.frozen
class ServedRun:
    """`memstep serve` (random:tiny, 10 KV pages) driven over ZMQ and HTTP: its event log, its
    JSON log lines at debug level, and what the clients saw."""

    log: Path
    lines: list[dict]
    seen: dict


@pytest.fixture(scope="session")
def served_run(tmp_path_factory) -> ServedRun:
    from served_run import serve_and_drive

    return ServedRun(*serve_and_drive(tmp_path_factory.mktemp("served")))
