"""Reports memory that grows while serving, from real measurements, not from the arena's books.

After the first serving step nothing should be allocated that outlives a step: logits, sampler
intermediates and every kind's buffers are persistent.  Two kinds of growth over the level
measured after that step are reported, because they have different causes and fixes:

* `live_growth`: live bytes grew, so something kept a tensor (a leak);
* `fragmentation`: reserved bytes grew while live bytes did not, so the caching allocator
  took new memory (new or larger segments) for short-lived tensors of sizes it had no cached
  block for: the seed's sampler incident.  Its detail names the allocator segments too.

(On CPU reserved equals live, so only live growth can be seen there.)  The detector names the
step and kind where growth began, then watches the new level: one report per growth episode,
and none for `quiet_steps` after it.

A third kind, `host_growth`, watches the executor's resident host memory, which no tensor figure
shows (core/host_memory.py): growth past `host_tolerance` bytes.
"""

from __future__ import annotations

from memstep.core.host_memory import MIB, HostWatch
from memstep.events.types import LeakSuspected, MemoryReport


class LeakDetector:
    def __init__(self, quiet_steps: int = 50, host_tolerance: int = 64 * MIB):
        self.quiet_steps = quiet_steps
        self.baseline: MemoryReport | None = None
        self._quiet_until = -1
        self.host = HostWatch("executor", host_tolerance)

    def observe(self, step: int, kind: str, mem: MemoryReport) -> list[LeakSuspected]:
        host = self.host.observe(step, kind, mem.executor_rss_bytes)
        return self._device(step, kind, mem) + host

    def _device(self, step: int, kind: str, mem: MemoryReport) -> list[LeakSuspected]:
        if self.baseline is None:
            self.baseline = mem
            return []
        base = self.baseline
        grew = mem.live_bytes - base.live_bytes
        reserved_grew = mem.reserved_bytes - base.reserved_bytes
        if step < self._quiet_until:
            self.baseline = mem if grew > 0 or reserved_grew > 0 else base
            return []
        if grew <= 0 and reserved_grew <= 0:
            return []
        self.baseline = mem
        self._quiet_until = step + self.quiet_steps
        detail = (
            f"live bytes {base.live_bytes} -> {mem.live_bytes} ({grew:+}), "
            f"segments {base.num_segments} -> {mem.num_segments}, "
            f"reserved {base.reserved_bytes} -> {mem.reserved_bytes} ({reserved_grew:+})"
        )
        if grew > 0:
            return [LeakSuspected(step, kind, "live_growth", grew, detail)]
        return [LeakSuspected(step, kind, "fragmentation", reserved_grew, detail)]
