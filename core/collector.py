"""The cyclic garbage collector's threshold in the engine core's process.

A step with a thousand running requests makes some ten thousand containers (plan rows, outputs,
records, lists) that live until the step ends and are then freed by reference counting.  With
Python's default threshold (700 young objects) the collector runs a dozen times in such a step,
and every tenth young collection walks the older generation too: all the running requests'
objects, a few milliseconds a step for nothing, since those objects are not garbage.  The core
process raises the young threshold above a step's objects; what is cyclic garbage still goes,
a few steps later.  An HTTP front's process does the same: a step's chunks make as many.  The
executor's process keeps the default: its memory meter walks the collector's objects itself
(executors/runtime/memory.py).
"""

from __future__ import annotations

import gc

CORE_GC_THRESHOLD = 50_000  # young objects between collections; a step makes some 10k


def tune_for_core() -> None:
    """Raise the young generation's threshold to CORE_GC_THRESHOLD; the older ones keep theirs."""
    gc.set_threshold(CORE_GC_THRESHOLD, *gc.get_threshold()[1:])
