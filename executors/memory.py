"""Real memory figures, measured independently of the arena's bookkeeping.

CUDA: the caching allocator's own statistics.  CPU: the bytes of every live tensor storage,
deduplicated by storage.  Walking every object the garbage collector tracks costs ~100 ms with a
model loaded, so `LiveTensorMeter.freeze` (called once start-up is done) moves start-up objects
to Python's permanent generation and remembers the tensors among them by weak reference; each
measurement then walks only what was created since, plus those weak references.
"""

from __future__ import annotations

import gc
import weakref

import torch

_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class LiveTensorMeter:
    def __init__(self) -> None:
        self._frozen: list[weakref.ref] = []

    def freeze(self) -> None:
        gc.unfreeze()  # an earlier engine in this process may have frozen tensors still alive
        gc.collect()
        self._frozen += [
            weakref.ref(o)
            for o in gc.get_objects()
            if type(o) in _TENSOR_TYPES and o.device.type == "cpu"
        ]
        gc.freeze()

    def measure(self) -> tuple[int, int]:
        """(bytes, count) of distinct live CPU tensor storages."""
        seen: dict[int, int] = {}
        for ref in self._frozen:
            t = ref()
            if t is not None:
                ptr, n = _storage(t)
                seen[ptr] = n
        for obj in gc.get_objects():
            if type(obj) in _TENSOR_TYPES and obj.device.type == "cpu":
                ptr, n = _storage(obj)
                seen[ptr] = n
        return sum(seen.values()), len(seen)


def measure(device: torch.device, meter: LiveTensorMeter) -> dict[str, int]:
    """live, reserved, segments, allocs for `device`."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {
            "live_bytes": stats.get("allocated_bytes.all.current", 0),
            "reserved_bytes": stats.get("reserved_bytes.all.current", 0),
            "num_segments": stats.get("segment.all.current", 0),
            "num_allocs": stats.get("allocation.all.allocated", 0),
        }
    live, count = meter.measure()
    return {"live_bytes": live, "reserved_bytes": live, "num_segments": count, "num_allocs": 0}
