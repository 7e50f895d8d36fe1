"""The seam between the core and its executors: the `Executor` Protocol refuses what is not one,
and the memory plan comes back as a typed record that the log keeps."""

from __future__ import annotations

import pytest

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.executor import Checked, Executor, OwnProcess, Submits, require_executor
from memstep.events.log import read_log
from memstep.events.plan import MemoryPlan, MemoryPlanned
from memstep.executors.process.inprocess import InProcessExecutor
from memstep.replay.recorder import Recorder

TINY = EngineConfig(model="random:tiny", max_num_seqs=4, num_threads=1, cpu_kv_cache_bytes=2**20)


class NoExecute:
    """Everything an executor has but `execute`."""

    def __init__(self, cfg, max_model_len):
        self.inner = InProcessExecutor(cfg, max_model_len)

    def enter_phase(self, phase, step):
        return self.inner.enter_phase(phase, step)

    def close(self):
        self.inner.close()


def test_an_executor_missing_a_required_method_is_refused_at_start():
    with pytest.raises(TypeError, match=r"NoExecute is not an executor: it has no execute\(\)"):
        Engine(TINY, NoExecute)


def test_the_protocol_names_the_optional_capabilities():
    executor = require_executor(InProcessExecutor(TINY, 64))
    assert isinstance(executor, Executor)
    assert not isinstance(executor, Submits | Checked | OwnProcess)  # all in this process
    executor.close()
    with pytest.raises(TypeError, match="has no enter_phase"):
        require_executor(object())


def test_the_memory_plan_is_a_typed_record_in_the_log(tmp_path):
    path = tmp_path / "run.memlog"
    recorder = Recorder(path)
    engine = Engine(TINY, InProcessExecutor, sinks=[recorder])
    try:
        assert isinstance(engine.memory_plan, MemoryPlan)
        assert engine.blocks.num_blocks == engine.memory_plan.num_kv_blocks > 0
    finally:
        engine.shutdown()
        recorder.close()
    _, records, problems = read_log(path)
    assert not problems
    planned = [r for r in records if isinstance(r, MemoryPlanned)]
    assert [p.plan for p in planned] == [engine.memory_plan]
