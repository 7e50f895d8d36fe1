"""One rank's end of the tensor-parallel group: the torch.distributed calls the executor makes.

Two groups over the same ranks.  The control group is gloo (CPU tensors): rank 0 broadcasts
each message of the core to the other ranks and gathers their replies.  The compute group
carries the model's collectives: the same gloo group on CPU, an NCCL group on CUDA (made once
the rank knows its device), whose all-reduces run inside captured CUDA graphs.

A collective that fails means a peer is gone (gloo sees the closed connection) and the group
cannot be repaired: the rank exits at once (`_broken`), so that the core sees a process die
and restarts the whole executor.  Waiting for the core is normal, so the control group's
timeout is long; the NCCL group's is short, since no kernel legitimately waits minutes.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from typing import TypeVar

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger("memstep.executor.ranks")

IDLE_TIMEOUT = datetime.timedelta(days=7)  # ranks 1..N-1 wait here while the core is idle
NCCL_TIMEOUT = datetime.timedelta(seconds=120)
BROKEN_EXIT_CODE = 4

T = TypeVar("T")

# torch 2.13 renamed all_gather_into_tensor (which now warns); older ones have only that name
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _broken(what: str, exc: BaseException) -> None:
    log.error("tensor-parallel group broken", during=what, error=str(exc))
    os._exit(BROKEN_EXIT_CODE)


def _guard(what: str, call: Callable[[], T]) -> T:
    try:
        return call()
    except (RuntimeError, dist.DistError) as exc:
        _broken(what, exc)
        raise  # not reached


class RankGroup:
    """This process's rank among `size`, joined at `init_method` (tcp://HOST:PORT)."""

    def __init__(self, rank: int, size: int, init_method: str):
        self.rank, self.size = rank, size
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=size, timeout=IDLE_TIMEOUT
        )
        self.control = dist.group.WORLD
        self.compute = self.control
        self._token = torch.zeros(1)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def gpu(self) -> torch.device:
        """This rank's GPU, one per rank of a machine (rank modulo its GPU count), and the NCCL
        group for the model's collectives on it (on the CPU the ranks keep their gloo group)."""
        device = torch.device("cuda", self.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        # without it every tensor an all-reduce touches is held for the NCCL stream until its
        # event is seen, so the caching allocator could not reuse it at once and would grow
        os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
        self.compute = dist.new_group(backend="nccl", timeout=NCCL_TIMEOUT)
        return device

    # --- the model's collectives ---------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (graph-capturable on NCCL); returns `x`."""
        _guard("all_reduce", lambda: dist.all_reduce(x, group=self.compute))
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on each rank -> [N, size * C], rank r's columns at r*C (vocabulary shards)."""
        n = x.shape[0]
        out = torch.empty((self.size * n, x.shape[1]), dtype=x.dtype, device=x.device)
        # into one tensor: all_gather's list of outputs outlives the call in a reference cycle
        gather = _all_gather_single
        _guard("all_gather", lambda: gather(out, x.contiguous(), group=self.compute))
        return out.view(self.size, n, -1).transpose(0, 1).reshape(n, -1)  # [N, size*C]

    def settle(self) -> None:
        """Let gloo drop the tensors of the collectives done so far, before memory is measured.

        Gloo's worker threads (two) let go of a finished collective's tensors only after its
        caller has returned, so a step's transient tensors could pass for a leak.  Tiny
        collectives on a persistent tensor, one per thread, and a pause that hands them the
        GIL let them finish: a race narrowed, not closed (it cannot be from Python; no false
        report was seen since, in about ten runs of the tests on a crowded 2-core machine)."""
        for _ in range(2):  # twice over: on a crowded machine a thread may be late to run
            for _ in range(2):
                _guard("all_reduce", lambda: dist.all_reduce(self._token, group=self.control))
            time.sleep(0.001)  # and the GIL, which they need to drop the Python side of a tensor

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV pages that fit on every rank)."""
        t = torch.tensor([value], dtype=torch.int64)
        op = dist.ReduceOp.MIN
        _guard("all_reduce(min)", lambda: dist.all_reduce(t, op=op, group=self.control))
        return int(t.item())

    # --- messages between rank 0 and the others ----------------------------------------------

    def broadcast_frame(self, frame: bytes | None) -> bytes:
        """Rank 0 sends `frame`, every other rank passes None and gets it: the same bytes the
        core sent, so every rank decodes the same message."""
        size = torch.tensor([len(frame) if frame is not None else 0], dtype=torch.int64)
        _guard("broadcast", lambda: dist.broadcast(size, 0, group=self.control))
        if frame is not None:
            data = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        else:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        _guard("broadcast", lambda: dist.broadcast(data, 0, group=self.control))
        return frame if frame is not None else data.numpy().tobytes()

    def gather_frames(self, frame: bytes) -> list[bytes]:
        """Every rank's `frame`, in rank order, on rank 0 (others get []).  All-gathered into
        one tensor (replies are hundreds of bytes): gloo's gather takes a list of outputs, and
        such a list outlives the call in a reference cycle, which the leak detector would see."""
        sizes = torch.zeros(self.size, dtype=torch.int64)
        size = torch.tensor([len(frame)], dtype=torch.int64)
        gather = _all_gather_single
        _guard("all_gather", lambda: gather(sizes, size, group=self.control))
        longest = int(sizes.max().item())
        data = torch.zeros(longest, dtype=torch.uint8)
        data[: len(frame)] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        frames = torch.empty(self.size * longest, dtype=torch.uint8)
        _guard("all_gather", lambda: gather(frames, data, group=self.control))
        if not self.is_first:
            return []
        rows = frames.view(self.size, longest)
        return [row[: int(n)].numpy().tobytes() for row, n in zip(rows, sizes, strict=True)]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
