"""The core's view of a tensor-parallel executor's ranks 1..N-1 that run on its machine.

`ProcessExecutor` starts rank 0 itself (it speaks to it); this module starts the others, on the
same init method, and tells whether any has died: a rank's death is the executor's death, so
the core kills every rank and recovery starts a whole new group.  Ranks on other machines are
started there (`memstep executor --rank R`); the core learns of their death through rank 0,
which exits when a collective with them fails.  No torch here: the core never loads it.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

from memstep.core.config import EngineConfig


def loopback_init_method() -> str:
    """tcp://127.0.0.1:<a port free now> for a group whose ranks all run here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def rank_arguments(cfg: EngineConfig, init_method: str) -> list[str]:
    """What every rank's command line adds when the executor is more than one rank."""
    if cfg.tensor_parallel_size == 1:
        return []
    return [
        "--tensor-parallel-size",
        str(cfg.tensor_parallel_size),
        "--distributed-init-method",
        init_method,
    ]


def how_it_ended(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class LocalRanks:
    """Ranks 1..num_local_ranks-1 of `cfg`, started with `env` and logging to our stderr."""

    def __init__(self, cfg: EngineConfig, init_method: str, env: dict, log_args: list[str]):
        num_local = cfg.num_local_ranks or cfg.tensor_parallel_size
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "memstep.executors.process", "--rank", str(rank)]
                + rank_arguments(cfg, init_method)
                + log_args,
                stdin=subprocess.DEVNULL,
                stdout=sys.stderr.fileno(),
                env=env,
            )
            for rank in range(1, num_local)
        ]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def why_dead(self) -> str | None:
        """Which ranks have exited, and how; None while every one runs."""
        dead = [
            f"rank {rank} (process {p.pid}, {how_it_ended(code)})"
            for rank, p in enumerate(self.procs, start=1)
            if (code := p.poll()) is not None
        ]
        return "executor " + ", ".join(dead) + " died" if dead else None

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def wait(self, timeout: float) -> None:
        """Let the ranks leave by themselves (after ExecutorStop), then kill those that did not."""
        for p in self.procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
