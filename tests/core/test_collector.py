"""The engine core process's collector threshold: raised above a step's objects, and cyclic
garbage is still collected under it."""

from __future__ import annotations

import gc
import weakref

from memstep.core import collector


class _Node:
    pass


def test_the_core_threshold_is_raised_and_cycles_are_still_collected():
    old = gc.get_threshold()
    try:
        collector.tune_for_core()
        assert gc.get_threshold() == (collector.CORE_GC_THRESHOLD, *old[1:])
        first = _Node()
        first.me = first  # a cycle: only the collector frees it
        ref = weakref.ref(first)
        del first
        for _ in range(collector.CORE_GC_THRESHOLD):  # twice the threshold: a node and its dict
            node = _Node()
            node.me = node
        assert ref() is None, "a cycle older than the threshold's young objects was collected"
    finally:
        gc.set_threshold(*old)
