"""The memory arena: one allocation made at profile time, carved into the step kinds' buffers.

Enter hooks claim named buffers, exit hooks release them, and the ledger says who holds what
since which step.  Claimed buffers are views of the arena, so claiming and releasing never
touches the device allocator.  A released buffer that is still referenced somewhere (kept on
`self`, say) is reported by `check_released` as held after exit.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch

from memstep.core.shapes import cdiv
from memstep.events.types import LedgerEntry

ALIGN = 256


class ArenaFull(RuntimeError):
    pass


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """The bytes of the elements of `tensors` (None counts nothing)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _aligned(n: int) -> int:
    return cdiv(n, ALIGN) * ALIGN


class Arena:
    def __init__(self, size: int, device: torch.device):
        self.size = _aligned(size)
        self.storage = torch.zeros(self.size, dtype=torch.uint8, device=device)
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, length), sorted
        self._held: dict[tuple[str, str], tuple[int, int, int]] = {}  # -> (offset, length, step)
        self._released: list[tuple[str, str, weakref.ref]] = []

    @property
    def claimed_bytes(self) -> int:
        return sum(length for _, length, _ in self._held.values())

    def ledger(self) -> list[LedgerEntry]:
        return [
            LedgerEntry(owner, name, length, step)
            for (owner, name), (_, length, step) in sorted(self._held.items())
        ]

    def claim(
        self, owner: str, name: str, shape: tuple[int, ...], dtype: torch.dtype, step: int
    ) -> torch.Tensor:
        key = (owner, name)
        if key in self._held:
            raise RuntimeError(f"{owner} claims {name} twice")
        need = _aligned(nbytes_of(shape, dtype))
        for i, (offset, length) in enumerate(self._free):
            if length >= need:
                self._free[i] = (offset + need, length - need)
                if self._free[i][1] == 0:
                    del self._free[i]
                self._held[key] = (offset, need, step)
                raw = self.storage[offset : offset + nbytes_of(shape, dtype)]
                return raw.view(dtype).view(shape)
        raise ArenaFull(f"arena of {self.size} bytes cannot fit {owner}.{name} ({need} bytes)")

    def release(self, owner: str, name: str, tensor: torch.Tensor | None = None) -> int:
        offset, length, _ = self._held.pop((owner, name))
        self._free.append((offset, length))
        self._free.sort()
        self._coalesce()
        if tensor is not None:
            self._released.append((owner, name, weakref.ref(tensor)))
        return length

    def check_released(self) -> list[tuple[str, str]]:
        """Buffers released by an exit hook but still referenced: (owner, name) of each."""
        held = [(owner, name) for owner, name, ref in self._released if ref() is not None]
        self._released.clear()
        return held

    def _coalesce(self) -> None:
        merged: list[tuple[int, int]] = []
        for offset, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((offset, length))
        self._free = merged
