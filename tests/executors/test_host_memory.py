"""Host memory: each process's resident bytes in every step's memory report, the watch that
reports their growth past a tolerance, a planted host leak in a real executor process flagged
and named, a clean run silent, and replay leaving the OS's figures out of its comparison."""

from __future__ import annotations

import attrs

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.host_memory import MIB, HostWatch, rss_bytes
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import LeakSuspected, MemoryReport, StepFinished
from memstep.executors.remote import ProcessExecutor
from memstep.replay.compare import compare


def watch(series: list[int], tolerance: int = 64 * MIB) -> list[LeakSuspected]:
    w = HostWatch("executor", tolerance)
    return [leak for step, rss in enumerate(series) for leak in w.observe(step, "k", rss)]


def test_growth_within_the_tolerance_is_silent():
    assert watch([500 * MIB + (i % 7) * 9 * MIB for i in range(300)]) == []


def test_growth_past_the_tolerance_is_named_host_memory_once_per_tolerance():
    series = [500 * MIB] * 5 + [500 * MIB + i * 4 * MIB for i in range(1, 40)]
    leaks = watch(series)
    # 4 MiB a step: past 64 MiB at the 17th step of growth, and again 17 steps later
    assert [(leak.step, leak.what) for leak in leaks] == [(21, "host_growth"), (38, "host_growth")]
    assert leaks[0].nbytes == 68 * MIB
    assert "host memory: executor RSS 500.0 MiB at step 0 -> 568.0 MiB" in leaks[0].detail


def test_an_unmeasured_process_is_silent():
    assert watch([0] * 10 + [10**12] * 10) == []


def _run(plant: str | None, num_requests: int = 48) -> list[object]:
    """random:tiny in a real executor process; short requests, all at once."""
    cfg = EngineConfig(model="random:tiny", max_num_seqs=8, num_threads=1, debug_plant_leak=plant)
    records: list[object] = []
    engine = Engine(cfg, ProcessExecutor, [records.append])
    try:
        for i in range(num_requests):
            engine.add_request([1 + i % 50, 2, 3, 4], SamplingParams(max_tokens=4, seed=i))
        engine.run_until_idle()
    finally:
        engine.shutdown()
    return records


def test_a_planted_host_leak_is_flagged_within_50_steps_and_named():
    records = _run("executor_host_bytes")
    steps = [r for r in records if isinstance(r, StepFinished)]
    leaks = [r for r in records if isinstance(r, LeakSuspected)]
    assert leaks, "4 MiB kept per request: 17 requests pass the 64 MiB tolerance"
    first = leaks[0]
    assert (first.what, first.kind) == ("host_growth", "no_spec")
    assert first.step - steps[0].step < 50
    assert "host memory: executor RSS" in first.detail and first.nbytes > 64 * MIB
    assert all(leak.what == "host_growth" for leak in leaks), "no tensor grew"
    assert steps[-1].memory.executor_rss_bytes - steps[0].memory.executor_rss_bytes > 64 * MIB


def test_a_clean_run_is_silent_and_reports_both_processes():
    records = _run(None)
    assert [r for r in records if isinstance(r, LeakSuspected)] == []
    mems = [r.memory for r in records if isinstance(r, StepFinished)]
    assert all(m.executor_rss_bytes > 0 and m.core_rss_bytes > 0 for m in mems)
    assert mems[0].core_rss_bytes != mems[0].executor_rss_bytes, "two processes"
    assert abs(mems[-1].core_rss_bytes - rss_bytes()) < 64 * MIB


def _step(rss: int, leaks: list[LeakSuspected]) -> list[object]:
    mem = MemoryReport(1000, 1000, 3, 0, 0, 0, 0, executor_rss_bytes=rss, core_rss_bytes=rss)
    return [StepFinished(7, "no_spec", [], 0, 0, mem), *leaks]


def test_replay_leaves_host_figures_out_but_not_device_figures():
    host = LeakSuspected(7, "no_spec", "host_growth", 70 * MIB, "host memory: ...")
    assert compare(_step(500 * MIB, [host]), _step(900 * MIB, [])).is_identical
    device = LeakSuspected(7, "no_spec", "live_growth", 4096, "live bytes ...")
    assert not compare(_step(500 * MIB, [device]), _step(500 * MIB, [])).is_identical
    recorded = _step(500 * MIB, [])
    edited = attrs.evolve(recorded[0], memory=attrs.evolve(recorded[0].memory, live_bytes=1))
    assert not compare(recorded, [edited]).is_identical
