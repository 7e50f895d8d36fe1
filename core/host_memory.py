"""Host memory: a process's resident set, and the watch that reports it growing.

Device memory is owned by the arena and measured tensor by tensor; host memory (Python objects,
native buffers of libraries, the allocator's arenas) is not, and grows in ways no tensor figure
shows: the leaks most often reported against LLM servers are of this kind.  Each process reads
its own resident set from /proc after every step.  Resident memory steps up by some megabytes as
libraries warm new shapes and the allocator keeps freed pages, then stays: a high-water mark, not
a leak.  What grows with the work done is told from it by core/growth.py's rule.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import attrs

from memstep.core.growth import FloorWatch, GrowthRule, Plateau, Slope, StepWork
from memstep.events.types import LeakSuspected

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


def rss_bytes(pid: int | str = "self") -> int:
    """Resident bytes of process `pid` (this one by default); 0 where /proc cannot tell."""
    try:
        data = _own_statm() if pid == "self" else Path(f"/proc/{pid}/statm").read_bytes()
        return int(data.split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


_statm: tuple[int, int] | None = None  # (pid, fd): this process's statm, kept open


def _own_statm() -> bytes:
    """This process's /proc statm, read from a descriptor opened once (read after every step;
    a forked child opens its own, since the parent's names the parent)."""
    global _statm
    if _statm is None or _statm[0] != os.getpid():
        _statm = (os.getpid(), os.open(f"/proc/{os.getpid()}/statm", os.O_RDONLY | os.O_CLOEXEC))
    return os.pread(_statm[1], 256, 0)


# a process's first requests warm what no figure of the device shows (imports done on first use,
# the allocator's arenas, libraries' first calls): its baseline is taken after more steps
HOST_RULE = GrowthRule(warmup_windows=3)


def machine_bytes() -> int:
    """The machine's physical memory (MemTotal), what a host slope is projected to; 0 if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def duration(seconds: float) -> str:
    """`seconds` as people say it: 3 h 10 min, 12 min, 40 s."""
    minutes = int(seconds // 60)
    if minutes >= 60:
        return f"{minutes // 60} h {minutes % 60} min"
    return f"{minutes} min" if minutes else f"{seconds:.0f} s"


class HostWatch:
    """Reports `process`'s resident bytes growing with the work done (core/growth.py's rule):
    a slope as `host_growth`, with its rate and when it would fill the machine at this run's
    pace; a plateau once as `host_high_water`.  A window's floor must rise more than `noise`
    bytes to count: resident memory moves by pages as the allocator keeps and returns them."""

    def __init__(self, process: str, noise: int, rule: GrowthRule = HOST_RULE):
        self.process = process
        self.watch = FloorWatch(attrs.evolve(rule, noise=noise))
        self.capacity = machine_bytes()
        self._started: tuple[int, float] | None = None  # (step, monotonic seconds)

    def observe(self, step: int, kind: str, rss: int, work: StepWork) -> list[LeakSuspected]:
        if rss <= 0:
            return []  # not measured on this host
        if self._started is None:
            self._started = (step, time.monotonic())
        seen = self.watch.observe(step, rss, work)
        if isinstance(seen, Plateau):
            detail = (
                f"high-water mark, not a leak: {self.process} RSS rose "
                f"{(seen.level - seen.base) / MIB:+.1f} MiB to {seen.level / MIB:.1f} MiB and has "
                f"stayed there {seen.flat_steps} steps"
            )
            return [
                LeakSuspected(seen.step, kind, "host_high_water", seen.level - seen.base, detail)
            ]
        if isinstance(seen, Slope):
            return [
                LeakSuspected(
                    seen.begin_step, kind, "host_growth", seen.growth, self._detail(step, seen)
                )
            ]
        return []

    def _detail(self, step: int, slope: Slope) -> str:
        detail = (
            f"host memory: {self.process} RSS {slope.base.floor / MIB:.1f} -> "
            f"{slope.last.floor / MIB:.1f} MiB ({slope.growth / MIB:+.1f} MiB) since step "
            f"{slope.base.step}, growing with the work ({slope.rate()}); no tensor holds it"
        )
        left = slope.steps_to(self.capacity)
        if left is None or self._started is None:
            return detail
        pace = (time.monotonic() - self._started[1]) / max(step - self._started[0], 1)
        return (
            f"{detail}; at this rate the {self.process} reaches the machine's memory "
            f"({self.capacity / (1 << 30):.1f} GiB) in {duration(left * pace)} ({left:,} steps)"
        )
