"""Real memory figures, measured independently of the arena's bookkeeping.

CUDA: the caching allocator's own statistics.  CPU: the bytes of every live tensor storage,
deduplicated by storage, that this worker's process did not already hold when the worker was
made (`LiveTensorMeter.exclude_existing`): a second engine in one process, or a test process with
other engines alive, measures what a fresh process would.  Walking every object the garbage
collector tracks costs ~100 ms with a model loaded, so `LiveTensorMeter.freeze` (called once
start-up is done) moves start-up objects to Python's permanent generation and remembers the
tensors among them by weak reference; each measurement then walks only what was created since,
plus those weak references.
"""

from __future__ import annotations

import gc
import weakref

import torch

_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _cpu_tensors(objects: list) -> list[torch.Tensor]:
    return [o for o in objects if type(o) in _TENSOR_TYPES and o.device.type == "cpu"]


class LiveTensorMeter:
    def __init__(self) -> None:
        self._frozen: list[weakref.ref] = []
        self._foreign: list[weakref.ref] = []

    def exclude_existing(self) -> None:
        """Leave out, for as long as they live, the CPU tensors alive now (not this worker's)."""
        gc.unfreeze()  # what an earlier engine or test froze is still someone else's
        gc.collect()
        self._foreign = [weakref.ref(t) for t in _cpu_tensors(gc.get_objects())]

    def adopt(self, tensors: list[torch.Tensor]) -> None:
        """Count `tensors` as this worker's although they were alive before it (the process's
        shared weight cache), so that a worker made after another measures what a fresh process
        does (a replay after an executor loss runs a second worker in one process)."""
        mine = {_storage(t)[0] for t in tensors if t.device.type == "cpu"}
        kept = [r for r in self._foreign if (t := r()) is None or _storage(t)[0] not in mine]
        self._foreign = kept

    def _foreign_alive(self) -> list[torch.Tensor]:
        return [t for t in (ref() for ref in self._foreign) if t is not None]

    def freeze(self) -> None:
        gc.unfreeze()
        gc.collect()
        foreign = {id(t) for t in self._foreign_alive()}
        self._frozen += [
            weakref.ref(t) for t in _cpu_tensors(gc.get_objects()) if id(t) not in foreign
        ]
        gc.freeze()

    def measure(self) -> tuple[int, int]:
        """(bytes, count) of distinct live CPU tensor storages, foreign ones left out."""
        foreign = {_storage(t)[0] for t in self._foreign_alive()}
        seen: dict[int, int] = {}
        for ref in self._frozen:
            t = ref()
            if t is not None:
                ptr, n = _storage(t)
                seen[ptr] = n
        for obj in _cpu_tensors(gc.get_objects()):
            ptr, n = _storage(obj)
            seen[ptr] = n
        return sum(n for ptr, n in seen.items() if ptr not in foreign), len(seen.keys() - foreign)


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
