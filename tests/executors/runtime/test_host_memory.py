"""Host memory: each process's resident bytes in every step's memory report, the watch that
reports their growth past a tolerance, a planted host leak in a real executor process flagged
and named, a clean run silent, replay leaving the OS's figures out of its comparison, and the
executor's bound on oneDNN's per-shape caches (the soak's growth) against unbounded ones."""

from __future__ import annotations

import mmap
import os

import attrs
import pytest
import torch

from memstep.core import host_memory
from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.core.growth import StepWork
from memstep.core.host_memory import MIB, HostWatch, rss_bytes
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import LeakSuspected, MemoryReport, StepFinished, is_leak
from memstep.executors.process.remote import ProcessExecutor
from memstep.executors.runtime import host_allocator
from memstep.replay.compare import compare


def watch(series: list[int], noise: int = 2 * MIB) -> list[LeakSuspected]:
    w = HostWatch("executor", noise)
    work = StepWork(4, 4, 1)  # a request admitted every step
    return [leak for step, rss in enumerate(series) for leak in w.observe(step, "k", rss, work)]


def _anon() -> int:
    """This process's anonymous resident bytes (statm's resident less shared), read through the
    descriptor rss_bytes() keeps open: the whole resident figure may not grow with a new block
    on a machine at its memory limit, where the kernel drops file-backed pages to make room."""
    fields = host_memory._own_statm().split()
    return (int(fields[1]) - int(fields[2])) * host_memory.PAGE_BYTES


def _touched(nbytes: int) -> mmap.mmap:
    """`nbytes` of new anonymous pages, each written. A mapping of its own, not malloc's: a
    long-lived test worker's heap may hold that much freed yet resident memory to reuse (a CI
    worker read the same figure to the byte before and after a 128 MiB bytes object)."""
    block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for offset in range(0, nbytes, host_memory.PAGE_BYTES):
        block[offset] = 1
    return block


def test_own_resident_bytes_follow_growth_and_a_forked_child_reads_its_own():
    """rss_bytes() reads this process's statm from a descriptor kept open: it follows memory
    touched since, and a forked child (whose inherited descriptor names the parent) reads its
    own figure: its growth, which the parent's figure would not show."""
    before, rss = _anon(), rss_bytes()
    block = _touched(128 * MIB)
    fd = host_memory._statm[1] if host_memory._statm else None
    where = (host_memory._statm, os.getpid(), os.readlink(f"/proc/self/fd/{fd}") if fd else None)
    assert _anon() - before > 100 * MIB, (before, _anon(), rss, rss_bytes(), where)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: grows by 256 MiB, reports what it reads of itself
        start = _anon()
        more = _touched(256 * MIB)
        grown, by_pid = _anon() - start, rss_bytes(os.getpid())
        os.write(write, f"{grown} {by_pid - rss_bytes()} {len(more)}".encode())
        os._exit(0)
    os.waitpid(pid, 0)
    grown, apart, _ = map(int, os.read(read, 128).split())
    os.close(read), os.close(write)
    assert grown > 200 * MIB, grown  # the parent's figure would not have moved
    assert abs(apart) < 16 * MIB, apart  # as /proc/<its pid>/statm reads
    block.close()


def test_resident_memory_that_moves_within_a_step_is_silent():
    assert watch([500 * MIB + (i % 7) * 9 * MIB for i in range(300)]) == []


def test_a_host_slope_is_named_with_its_rate_and_when_it_fills_the_machine():
    series = [500 * MIB] * 24 + [500 * MIB + i * MIB // 4 for i in range(1, 100)]
    leaks = watch(series)
    # 256 KiB a step, a request a step: under any fixed tolerance for a long time
    assert {leak.what for leak in leaks} == {"host_growth"} and 24 <= leaks[0].step < 64
    assert "host memory: executor RSS 500.0 -> " in leaks[0].detail
    assert "262,144 B/step, 262,144 B/request" in leaks[0].detail
    assert "at this rate the executor reaches the machine's memory" in leaks[0].detail


def test_a_host_step_up_that_stays_is_a_high_water_mark():
    leaks = watch([500 * MIB] * 20 + [566 * MIB] * 300)
    assert [leak.what for leak in leaks] == ["host_high_water"] and not leaks[0].is_leak


def test_an_unmeasured_process_is_silent():
    assert watch([0] * 10 + [10**12] * 10) == []


def _run(plant: str | None, num_requests: int = 96) -> list[object]:
    """random:tiny in a real executor process; short requests, all at once."""
    cfg = EngineConfig(model="random:tiny", max_num_seqs=8, num_threads=1, debug_plant_leak=plant)
    records: list[object] = []
    engine = Engine(cfg, ProcessExecutor, [records.append])
    try:
        for i in range(num_requests):
            engine.add_request(
                [1 + i % 50, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=4, seed=i)
            )
        engine.run_until_idle()
    finally:
        engine.shutdown()
    return records


def test_a_planted_host_leak_is_flagged_within_50_steps_and_named():
    records = _run("executor_host_bytes")
    steps = [r for r in records if isinstance(r, StepFinished)]
    leaks = [r for r in records if is_leak(r)]
    assert leaks, "4 MiB kept per request: the resident floor rises window after window"
    first = leaks[0]
    assert (first.what, first.kind) == ("host_growth", "no_spec")
    assert first.step - steps[0].step < 50
    assert "host memory: executor RSS" in first.detail and first.nbytes > 64 * MIB
    assert "B/request" in first.detail
    assert all(leak.what == "host_growth" for leak in leaks), "no tensor grew"
    assert steps[-1].memory.executor_rss_bytes - steps[0].memory.executor_rss_bytes > 64 * MIB


def test_a_clean_run_is_silent_and_reports_both_processes():
    records = _run(None)
    assert [r for r in records if is_leak(r)] == []
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


SHAPES = """
import sys, torch
from memstep.core.host_memory import rss_bytes
from memstep.executors.runtime import host_allocator
from memstep.executors.cpu.linear import wide_dense
if sys.argv[1] == "bounded":
    host_allocator.bound_onednn_caches()
torch.set_num_threads(1)
linear = wide_dense(torch.float32)
w = torch.randn(1536, 576)  # SmolLM2's gate-up
linear(torch.randn(3, 576), w)
trim = host_allocator.HostTrim()
start = rss_bytes()
for m in range(1, 201):  # a new number of tokens each step, as prompts of new lengths bring
    linear(torch.randn(m, 576), w)
    end = trim.measure()
print(end - start)
"""


def _growth(mode: str) -> int:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in host_allocator.CACHE_ENV_NAMES}
    done = subprocess.run(
        [sys.executable, "-c", SHAPES, mode], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_bounded_onednn_caches_keep_host_memory_flat_over_new_shapes():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")
    unbounded, bounded = _growth("unbounded"), _growth("bounded")
    assert unbounded > 64 * MIB, "1,024-entry caches: ~0.6 MiB kept for every new shape"
    # 32 shapes' worth of primitives and up to 16 MiB not yet trimmed: 121 MiB against 27 seen
    assert bounded < 48 * MIB and 3 * bounded < unbounded, (bounded, unbounded)
