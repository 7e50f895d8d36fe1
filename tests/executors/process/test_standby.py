"""The warm standby executor (random:tiny, real processes): a recovery adopts the loaded spare,
which takes the planted deaths of its new config and nothing else; a dead or mismatched spare is
replaced by a fresh start."""

from __future__ import annotations

import os
import signal
import time

import pytest

from memstep.core.config import EngineConfig
from memstep.core.recovery import ExecutorDown
from memstep.executors.process.remote import ExecutorFailed, ProcessExecutor
from memstep.executors.process.standby import StandbyExecutors

TINY = EngineConfig(model="random:tiny", num_threads=1, seed=1)
MAX_LEN = 256


def _loaded(factory: StandbyExecutors, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    while not factory.standby_pid:
        assert time.monotonic() < deadline, "the standby never loaded"
        time.sleep(0.1)
    return factory.standby_pid


@pytest.fixture
def factory():
    standby = StandbyExecutors(ProcessExecutor, delay_s=0.0)
    yield standby
    standby.close()


def test_a_recovery_adopts_the_loaded_standby_with_its_new_planted_deaths(factory):
    first = factory(TINY, MAX_LEN)
    spare = _loaded(factory)
    assert spare != first.pid
    first.close()
    start = time.monotonic()
    adopted = factory(TINY.replace(debug_kill_restarted_executor=True), MAX_LEN)
    took = time.monotonic() - start
    assert adopted.pid == spare and factory.num_adopted == 1
    assert took < 5.0, f"adopting a loaded standby took {took:.1f} s"
    adopted.enter_phase("profile", 0)
    with pytest.raises(ExecutorDown, match="SIGKILL"):  # the planted death it was adopted with
        adopted.enter_phase("warmup", 0)
    adopted.close()
    assert _loaded(factory) not in (first.pid, spare), "the next standby"


def test_a_standby_loaded_with_another_config_refuses_adoption(factory):
    factory(TINY, MAX_LEN).close()
    spare = _loaded(factory)
    launch = factory._launch
    assert launch is not None and launch.executor is not None
    with pytest.raises(ExecutorFailed, match="another config"):
        launch.executor.adopt(TINY.replace(max_num_seqs=3), MAX_LEN)
    fresh = factory(TINY.replace(max_num_seqs=3), MAX_LEN)  # the factory falls back to a start
    assert fresh.pid != spare and factory.num_adopted == 0
    fresh.close()


def test_a_dead_standby_is_replaced_by_a_fresh_start(factory):
    factory(TINY, MAX_LEN).close()
    spare = _loaded(factory)
    os.kill(spare, signal.SIGKILL)
    fresh = factory(TINY, MAX_LEN)
    assert fresh.pid != spare and factory.num_adopted == 0
    fresh.enter_phase("profile", 0)
    fresh.close()
