"""Reports memory that grows while serving, from real measurements, not from the arena's books.

After the first serving step nothing should be allocated that outlives a step: logits, sampler
intermediates and every kind's buffers are persistent.  So live bytes (and, on CUDA, allocator
segments) above the level measured after that step are growth; the detector names the step and
kind where growth began, then watches the new level (one report per growth episode).
"""

from __future__ import annotations

from memstep.events.types import LeakSuspected, MemoryReport


class LeakDetector:
    def __init__(self, quiet_steps: int = 50):
        self.quiet_steps = quiet_steps
        self.baseline: MemoryReport | None = None
        self._quiet_until = -1
        self._pending: tuple[int, str, int] | None = None

    def observe(self, step: int, kind: str, mem: MemoryReport) -> list[LeakSuspected]:
        if self.baseline is None:
            self.baseline = mem
            return []
        base = self.baseline
        grew = mem.live_bytes - base.live_bytes
        new_segments = mem.num_segments - base.num_segments
        if step < self._quiet_until:
            self.baseline = mem if grew > 0 else base
            return []
        if grew <= 0 and (new_segments <= 0 or mem.reserved_bytes <= base.reserved_bytes):
            return []
        self.baseline = mem
        self._quiet_until = step + self.quiet_steps
        detail = (
            f"live bytes {base.live_bytes} -> {mem.live_bytes} (+{grew}), "
            f"segments {base.num_segments} -> {mem.num_segments}, "
            f"reserved {base.reserved_bytes} -> {mem.reserved_bytes}"
        )
        return [LeakSuspected(step, kind, "live_growth", max(grew, 0), detail)]
