"""The CPU live-bytes meter counts what its own worker holds, not what else the process holds."""

from __future__ import annotations

import gc

import attrs
import torch

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import MemoryReport
from memstep.executors.process.inprocess import local_engine
from memstep.executors.runtime.memory import LiveTensorMeter

TINY = EngineConfig(model="random:tiny", max_num_seqs=4, num_threads=1)


def _first_step_memory(engine: Engine) -> dict:
    """The step's device figures (host RSS is the whole process's, not the meter's)."""
    engine.add_request([3, 4, 5], SamplingParams(temperature=0.0, max_tokens=2))
    engine.step()
    figures = attrs.asdict(engine.last_memory)
    return {k: v for k, v in figures.items() if k not in MemoryReport.HOST_MEASURED}


def test_a_second_engine_in_the_process_measures_what_the_first_did():
    first = local_engine(TINY)
    alone = _first_step_memory(first)
    ballast = torch.ones(1 << 20)  # 4 MiB more alive before the second engine starts
    second = local_engine(TINY)  # the first one, its weights and the ballast stay alive
    beside = _first_step_memory(second)
    assert beside == alone and alone["live_bytes"] > 0
    first.shutdown()
    second.shutdown()
    del ballast


def test_without_exclusion_the_other_engine_is_counted(monkeypatch):
    """The check above can fail: a meter that does not leave out what was alive counts it."""
    first = local_engine(TINY)
    alone = _first_step_memory(first)
    monkeypatch.setattr(LiveTensorMeter, "exclude_existing", lambda self: None)
    second = local_engine(TINY)
    beside = _first_step_memory(second)
    assert beside["live_bytes"] >= 2 * alone["live_bytes"] - (1 << 20)
    first.shutdown()
    second.shutdown()


def test_a_tensor_made_after_start_up_is_counted_and_freed_when_dropped():
    meter = LiveTensorMeter()
    meter.exclude_existing()
    meter.freeze()
    before, _ = meter.measure()
    grown = torch.zeros(1 << 18)  # 1 MiB
    after, _ = meter.measure()
    assert after - before == grown.untyped_storage().nbytes()
    del grown
    gc.collect()
    assert meter.measure()[0] == before
    gc.unfreeze()
