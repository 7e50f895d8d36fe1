"""`memstep executor --rank R`: tensor-parallel ranks on a machine other than the core's.

The core (`memstep serve --tensor-parallel-size N --num-local-ranks L
--distributed-init-method tcp://HOST:PORT`) starts ranks 0..L-1 itself; each other machine runs
this command for its ranks, with the same size and init method (HOST: the core's machine, where
rank 0 listens).  Each rank is a child process that joins the group, answers what rank 0
relays, and ends with the group: when the core stops, or when any rank dies (the core then
restarts the executor, and rank 0 forms a new group at the same address).  So this command
starts the rank again each time it ends, until interrupted (or once, with `--once`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import structlog

from memstep.cli.errors import UsageError
from memstep.core.config import EngineConfig
from memstep.executors.cpu.threads import executor_env
from memstep.executors.process.local_ranks import how_it_ended, rank_arguments

log = structlog.get_logger("memstep.cli.executor")

RESTART_PAUSE_S = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rank", type=int, action="append", required=True, help="rank(s) to run here")
    p.add_argument("--tensor-parallel-size", type=int, required=True, help="ranks in all")
    p.add_argument(
        "--distributed-init-method", required=True, help="tcp://HOST:PORT of the core's machine"
    )
    p.add_argument("--once", action="store_true", help="run each rank once, not again and again")


def run(args: argparse.Namespace) -> int:
    cfg = EngineConfig(
        model="random:tiny",  # only the group's shape is read here; rank 0 sends the real config
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_init_method=args.distributed_init_method,
        num_local_ranks=1,
    )
    bad = [r for r in args.rank if not 0 < r < cfg.tensor_parallel_size]
    if bad:
        raise UsageError(f"--rank must be in [1, {cfg.tensor_parallel_size}) here, got {bad}")
    command = rank_arguments(cfg, cfg.distributed_init_method or "")
    command += ["--log-level", args.log_level, "--log-format", args.log_format]
    procs = {r: _start(r, command) for r in args.rank}
    try:
        while procs:
            time.sleep(RESTART_PAUSE_S)
            for rank, proc in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                log.warning("rank ended", rank=rank, how=how_it_ended(code))
                if args.once:
                    del procs[rank]
                else:
                    procs[rank] = _start(rank, command)
    finally:
        for proc in procs.values():
            proc.kill()
    return 0


def _start(rank: int, command: list[str]) -> subprocess.Popen:
    log.info("rank starting", rank=rank)
    argv = [sys.executable, "-m", "memstep.executors.process", "--rank", str(rank), *command]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=executor_env(os.environ))
