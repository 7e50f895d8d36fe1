"""Host memory: a process's resident set, and the watch that reports it growing.

Device memory is owned by the arena and measured tensor by tensor; host memory (Python objects,
native buffers of libraries, the allocator's arenas) is not, and grows in ways no tensor figure
shows: the leaks most often reported against LLM servers are of this kind.  Each process reads
its own resident set from /proc after every step.  Resident memory moves by some megabytes as
libraries warm new shapes and the allocator keeps freed pages, so a report needs growth past a
tolerance over the level after the first serving step; after a report the new level is the
baseline, so a steady leak is reported once per tolerance it grows.
"""

from __future__ import annotations

import os
from pathlib import Path

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


class HostWatch:
    """Reports `process`'s resident bytes growing more than `tolerance` over its baseline, as
    `host_growth`, at the step where it passed the tolerance."""

    def __init__(self, process: str, tolerance: int):
        self.process = process
        self.tolerance = tolerance
        self.baseline: int | None = None
        self.baseline_step = 0

    def observe(self, step: int, kind: str, rss: int) -> list[LeakSuspected]:
        if rss <= 0:
            return []  # not measured on this host
        if self.baseline is None:
            self.baseline, self.baseline_step = rss, step
            return []
        grew = rss - self.baseline
        if grew <= self.tolerance:
            return []
        detail = (
            f"host memory: {self.process} RSS {self.baseline / MIB:.1f} MiB at step "
            f"{self.baseline_step} -> {rss / MIB:.1f} MiB ({grew / MIB:+.1f} MiB), past the "
            f"tolerance of {self.tolerance / MIB:.0f} MiB; no tensor holds it"
        )
        self.baseline, self.baseline_step = rss, step
        return [LeakSuspected(step, kind, "host_growth", grew, detail)]
