"""Fixtures of the router's tests: replicas as real `memstep serve` processes, a router turning
in a thread of the test, and a batch of seeded streaming requests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from router_helpers import MODEL

from memstep.cli.serve import ServerProcess


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServerProcess]]:
    """Two replicas of random:tiny, each its own core, executor and log (started together)."""
    procs = [ServerProcess(MODEL) for _ in range(2)]
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.close()
