"""The leak detector on synthetic memory series: each report kind fires on its own shape of
growth, once per episode, and a clean series is silent."""

from __future__ import annotations

from memstep.events.types import LeakSuspected, MemoryReport
from memstep.executors.runtime.leak_detector import LeakDetector

MIB = 1 << 20


def report(live: int, reserved: int, segments: int) -> MemoryReport:
    return MemoryReport(live, reserved, segments, 0, 0, 0)


def run(series: list[MemoryReport], quiet_steps: int = 50) -> list[LeakSuspected]:
    detector = LeakDetector(quiet_steps)
    return [leak for step, mem in enumerate(series) for leak in detector.observe(step, "k", mem)]


def flat(n: int) -> list[MemoryReport]:
    # live bytes dip and come back within a step's life; reserved and segments stay put
    return [report(100 * MIB - (i % 3) * MIB, 200 * MIB, 12) for i in range(n)]


def test_a_clean_series_is_silent():
    assert run(flat(300)) == []


def test_live_growth_is_named_as_such_once_per_episode():
    series = flat(10) + [report(101 * MIB + i, 200 * MIB, 12) for i in range(40)]
    series += [report(150 * MIB, 200 * MIB, 12)] * 20  # a second episode after the quiet steps
    leaks = run(series, quiet_steps=30)
    assert [(leak.step, leak.what) for leak in leaks] == [(10, "live_growth"), (40, "live_growth")]
    assert leaks[0].nbytes == 1 * MIB and "live bytes" in leaks[0].detail


def test_reserved_growth_without_live_growth_is_fragmentation():
    # the seed's shape: per-step scratch of new sizes, freed, but cached in new segments
    series = flat(7) + [report(100 * MIB, 200 * MIB + i * 4 * MIB, 12 + i) for i in range(1, 30)]
    leaks = run(series)
    assert [(leak.step, leak.what) for leak in leaks] == [(7, "fragmentation")]
    assert leaks[0].nbytes == 4 * MIB and "segments 12 -> 13" in leaks[0].detail


def test_live_growth_wins_when_both_grow():
    leaks = run(flat(5) + [report(120 * MIB, 260 * MIB, 14)])
    assert [(leak.what, leak.nbytes) for leak in leaks] == [("live_growth", 20 * MIB)]


def test_a_series_that_only_gives_memory_back_is_silent():
    series = flat(5) + [report(90 * MIB, 180 * MIB, 10)] * 20
    assert run(series) == []
