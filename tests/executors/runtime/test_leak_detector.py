"""The leak detector on synthetic memory series: a slope is reported with its rate and a
projection, a step up is a high-water mark (information, once), each report kind fires on its own
shape of growth, a clean series is silent, and the same series always gives the same reports."""

from __future__ import annotations

import itertools

from memstep.core.growth import StepWork
from memstep.events.types import LeakSuspected, MemoryReport
from memstep.executors.runtime.leak_detector import LeakDetector

MIB = 1 << 20
GIB = 1 << 30
DECODE = StepWork(4, 4, 0)  # a decode step of 4 requests
ADMIT = StepWork(4, 4, 1)  # one of them admitted


def report(live: int, reserved: int, segments: int) -> MemoryReport:
    return MemoryReport(live, reserved, segments, 0, 0, 0)


def run(series: list[MemoryReport], work=None) -> list[LeakSuspected]:
    detector = LeakDetector(capacity=16 * GIB)
    works = work or [ADMIT if i % 4 == 0 else DECODE for i in range(len(series))]
    return [
        leak
        for step, (mem, w) in enumerate(zip(series, works, strict=True))
        for leak in detector.observe(step, "k", mem, w)
    ]


def flat(n: int, live: int = 100 * MIB) -> list[MemoryReport]:
    # live bytes dip and come back within a step's life; reserved and segments stay put
    return [report(live - (i % 3) * MIB, 200 * MIB, 12) for i in range(n)]


def test_a_clean_series_is_silent():
    assert run(flat(400)) == []


def test_a_step_up_that_stays_is_a_high_water_mark_reported_once():
    series = flat(40) + flat(300, live=130 * MIB)
    leaks = run(series)
    assert [leak.what for leak in leaks] == ["high_water"]
    assert leaks[0].nbytes == 30 * MIB and "not a leak" in leaks[0].detail
    assert not leaks[0].is_leak


def test_a_slope_is_live_growth_with_its_rate_and_a_projection():
    # 64 KiB kept a step: under any fixed tolerance of 64 MiB for a thousand steps
    series = flat(16) + [report(100 * MIB + i * 65536, 200 * MIB, 12) for i in range(60)]
    leaks = run(series)
    assert [leak.what for leak in leaks] == ["live_growth"]
    leak = leaks[0]
    assert 16 <= leak.step < 24, "the window where the growth began"
    assert "65,536 B/step" in leak.detail and "B/request" in leak.detail
    assert "reaches the device's memory (16.0 GiB) in " in leak.detail


def test_a_tensor_kept_every_100_steps_is_a_slope_not_three_plateaus():
    series = [report(100 * MIB + (i // 100) * 4 * MIB, 200 * MIB, 12) for i in range(1, 420)]
    leaks = run(series)
    assert [leak.what for leak in leaks] == ["live_growth"], leaks
    assert leaks[0].step < 120 and "12,582,912" in leaks[0].detail  # +12 MiB over 3 rises


def test_reserved_growth_without_live_growth_is_fragmentation():
    # the seed's shape: per-step scratch of new sizes, freed, but cached in new segments
    series = flat(8) + [report(100 * MIB, 200 * MIB + i * 4 * MIB, 12 + i) for i in range(1, 40)]
    leaks = run(series)
    assert [leak.what for leak in leaks] == ["fragmentation"]
    assert "reserved bytes" in leaks[0].detail


def test_reserved_rising_with_the_largest_batch_is_a_high_water_mark():
    # the allocator caching a larger block for each new largest batch, then flat
    works = [StepWork(1 + i // 8, 1 + i // 8, 1) for i in range(64)] + [DECODE] * 300
    series = [report(100 * MIB, 200 * MIB + (i // 8) * MIB, 12) for i in range(64)]
    series += [report(100 * MIB, 207 * MIB, 12)] * 300
    leaks = run(series, works)
    assert [leak.what for leak in leaks] == ["high_water"], leaks


def test_live_growth_wins_when_both_grow():
    series = flat(8) + [report(100 * MIB + i * MIB, 200 * MIB + i * MIB, 12) for i in range(40)]
    assert [leak.what for leak in run(series)] == ["live_growth"]


def test_a_series_that_only_gives_memory_back_is_silent():
    assert run(flat(8) + [report(90 * MIB, 180 * MIB, 10)] * 200) == []


def test_a_steady_leak_is_reported_again_only_as_its_growth_doubles():
    series = flat(8) + [report(100 * MIB + i * MIB, 200 * MIB, 12) for i in range(400)]
    leaks = run(series)
    sizes = [leak.nbytes for leak in leaks]
    assert 3 <= len(leaks) <= 7 and all(b >= 2 * a for a, b in itertools.pairwise(sizes)), sizes


def test_the_same_series_gives_the_same_reports():
    series = flat(16) + [report(100 * MIB + i * 65536, 200 * MIB, 12) for i in range(90)]
    assert run(series) == run(series)
