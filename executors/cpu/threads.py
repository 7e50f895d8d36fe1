"""How the executor's CPU threads wait: the OpenMP wait policy, set before torch loads.

torch's CPU kernels run on an OpenMP pool whose idle threads spin for a while at every barrier,
waiting for the next parallel region.  On a machine where another job holds the cores, a
spinning worker takes the core its peer needs and the barrier waits out a scheduler slice.  A
passive policy puts idle threads to sleep at once.  On a crowded machine spinning threads made
steps many times slower, and the passive policy kept them near their quiet-machine time
(benchmarks/bench_contention.py; figures in docs/benchmarks.md).  So the thread count stays
torch's default (one per core; `EngineConfig.num_threads` overrides it) and the policy is
passive unless the environment names another.  Its price, without neighbours, is the time to
wake sleeping threads: set OMP_WAIT_POLICY=ACTIVE on a machine that serves alone.  The compiled
CPU kernels keep small work off the sleeping pool (`PARALLEL_MIN_WHEN_ASLEEP` in
executors/cpu/kernels.py), and a q4 model's decode step runs every layer in one parallel region
whose threads spin between its stages (executors/cpu/decode_step.py): the pool is woken once a
step.

The policy is read once, when torch's OpenMP runtime loads, so it must be in the environment
before the process imports torch: the process executor is started with it (`executor_env`), and
the `memstep` command sets it for its own process (`prefer_passive_wait`) before any sub-command
imports torch.  A process that loaded torch earlier keeps its policy; only the thread count can
still be set there.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping

WAIT_POLICY = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"
SPIN_COUNT = "GOMP_SPINCOUNT"  # libgomp's own: rounds an idle thread spins before it sleeps


def executor_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with a passive wait policy, unless it names a policy of its own."""
    return {WAIT_POLICY: PASSIVE, **env}


def prefer_passive_wait(env: MutableMapping[str, str] = os.environ) -> None:
    """A passive policy for this process, unless it names one or has loaded torch already."""
    if "torch" not in sys.modules:
        env.setdefault(WAIT_POLICY, PASSIVE)


def threads_sleep_when_idle(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the OpenMP pool's idle threads sleep at once (a passive policy, or no spinning),
    so that every parallel region pays for waking them: libgomp takes GOMP_SPINCOUNT over
    the policy when both are set."""
    if SPIN_COUNT in env:
        return env[SPIN_COUNT].strip() == "0"
    return env.get(WAIT_POLICY, "").strip().upper() == PASSIVE


@contextlib.contextmanager
def small_work(cpu: bool) -> Iterator[None]:
    """torch's ops on the calling thread alone inside, where `cpu` and the pool's threads sleep
    between regions: for many small ops (the EAGLE head's drafts) that would each pay for
    waking them. Outputs computed one per thread (matmuls, elementwise) are the same either
    way; a reduction may be split otherwise."""
    if not (cpu and threads_sleep_when_idle()):
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
