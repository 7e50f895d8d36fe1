"""Reports memory that grows with the work while serving, from real measurements, not from the
arena's books.

After warm-up nothing should be allocated that outlives a step: logits, sampler intermediates,
every kind's buffers and the prompt scorer's rows are persistent.  Each figure (live bytes,
reserved bytes, allocator segments, the executor's resident host memory) is judged by
core/growth.py's rule, which tells a slope (growth with the work done) from a high-water mark
(a step up under a new shape of work that then stays).  A slope is reported with its rate and
a projection; a plateau once, as information (`high_water`, `host_high_water`, not leaks):

* `live_growth`: live bytes grow, so something keeps tensors (a leak);
* `fragmentation`: reserved bytes or segments grow while live bytes do not, so the caching
  allocator takes new memory for short-lived tensors of sizes it has no cached block for (the
  seed's sampler incident).  On the CPU reserved equals live, so only live growth shows there;
* `host_growth`: the executor's resident host memory grows (core/host_memory.py).

Device figures are judged from the step plans and measured figures alone, so a replay reports
them the same way; host figures differ from run to run and replay compares none of them.
"""

from __future__ import annotations

import attrs

from memstep.core.growth import FloorWatch, GrowthRule, Plateau, Slope, StepWork
from memstep.core.host_memory import MIB, HostWatch
from memstep.events.types import LeakSuspected, MemoryReport

GIB = 1 << 30
DEVICE_FIGURES = ("live_bytes", "reserved_bytes", "num_segments")
DEVICE_NOISE = {"live_bytes": 0, "reserved_bytes": 0, "num_segments": 0}


class LeakDetector:
    def __init__(
        self, capacity: int = 0, host_noise: int = 2 * MIB, rule: GrowthRule | None = None
    ):
        """`capacity`: the device's memory (the machine's for the CPU), slopes are projected to."""
        rule = rule or GrowthRule()
        self.capacity = capacity
        self.figures = {
            name: FloorWatch(
                attrs.evolve(rule, noise=DEVICE_NOISE[name], shapes_explain=name != "live_bytes")
            )
            for name in DEVICE_FIGURES
        }
        self.host = HostWatch("executor", host_noise)

    def observe(
        self, step: int, kind: str, mem: MemoryReport, work: StepWork
    ) -> list[LeakSuspected]:
        seen = {name: w.observe(step, getattr(mem, name), work) for name, w in self.figures.items()}
        host = self.host.observe(step, kind, mem.executor_rss_bytes, work)
        return self._device(kind, seen) + host

    def _device(self, kind: str, seen: dict[str, Slope | Plateau | None]) -> list[LeakSuspected]:
        slopes = {name: s for name, s in seen.items() if isinstance(s, Slope)}
        if "live_bytes" in slopes:
            s = slopes["live_bytes"]
            return [LeakSuspected(s.begin_step, kind, "live_growth", s.growth, self._slope(s))]
        live = self.figures["live_bytes"]
        slopes = {
            name: s
            for name, s in slopes.items()
            if 2 * (live.level - live.level_at(s.first.step)) < _bytes_grown(name, s)
        }
        if slopes:  # reserved memory or segments grew while live bytes did not (by half as much)
            name, s = next(iter(slopes.items()))
            segments = f"; allocator segments {self.figures['num_segments'].level}"
            detail = self._slope(s, name) + segments
            return [LeakSuspected(s.begin_step, kind, "fragmentation", s.growth, detail)]
        plateau = seen["live_bytes"] or seen["reserved_bytes"]
        if isinstance(plateau, Plateau):
            grew = plateau.level - plateau.base
            detail = (
                f"high-water mark, not a leak: device memory rose {grew:+,} B to "
                f"{plateau.level:,} B and has stayed there {plateau.flat_steps} steps"
            )
            return [LeakSuspected(plateau.step, kind, "high_water", grew, detail)]
        return []

    def _slope(self, s: Slope, name: str = "live_bytes") -> str:
        figure = name.replace("_", " ")
        unit = "segments" if name == "num_segments" else "B"
        detail = (
            f"{figure} {s.base.floor:,} -> {s.last.floor:,} ({s.growth:+,}) since step "
            f"{s.base.step}, growing with the work ({s.rate(unit)})"
        )
        left = s.steps_to(self.capacity) if unit == "B" else None
        if left is None:
            return detail
        return (
            f"{detail}; at this rate the executor reaches the device's memory "
            f"({self.capacity / GIB:.1f} GiB) in {left:,} steps"
        )


def _bytes_grown(name: str, s: Slope) -> int:
    """What a figure grew by over its slope's span, in bytes (segments: 1, whatever the size:
    with live bytes grown at all, a segment more is no sign of fragmentation)."""
    return 1 if name == "num_segments" else s.last.floor - s.first.floor
