"""Executor recovery time through a real `memstep serve`: the executor SIGKILLed from outside
`--kills` times under streaming traffic, with and without the warm standby executor.

Each kill waits until the server is healthy again (and, with the standby, until the next
standby has loaded), so every recovery is of the same kind.  The seconds are the engine's own
`RecoveryDone.seconds` from the server's event log (from the loss to the new executor profiled,
warmed up and captured); the pause is the longest silence a streaming client saw around each
kill.  Host memory of each process is read from StatsReply at the end: the standby's is the price.

    python benchmarks/bench_recovery.py [--model smollm2] [--standby on|off|both] [--kills 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time

from memstep.api.client import Client
from memstep.cli.serve import ServerProcess
from memstep.events.types import RecoveryDone
from memstep.replay.recording import load


class Traffic(threading.Thread):
    """Greedy streams, one after another, until stopped; records when each token came."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.address = address
        self.stopped = threading.Event()
        self.times: list[float] = []
        self.errors: list[str] = []

    def run(self) -> None:
        with Client(self.address, timeout=120) as client:
            i = 0
            while not self.stopped.is_set():
                prompt = f"Write one sentence about the number {i}."
                try:
                    for _ in client.generate(
                        prompt, stream=True, max_tokens=48, ignore_eos=True, temperature=0.0
                    ):
                        self.times.append(time.monotonic())
                except Exception as exc:  # counted and shown: a recovery must cause none
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                i += 1

    def pause_around(self, moment: float) -> float:
        """The longest gap between tokens that spans `moment`."""
        gaps = [b - a for a, b in zip(self.times, self.times[1:], strict=False) if a <= moment <= b]
        return max(gaps, default=float("nan"))


def _wait(client: Client, ready, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready(client):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout} s")
        time.sleep(0.2)


def run(model_args: list[str], standby: str, kills: int) -> dict:
    args = [*model_args, "--standby-executor", standby, "--max-executor-restarts", str(kills + 1)]
    with ServerProcess(args) as server:
        server.wait_ready(600)
        traffic = Traffic(server.address)
        traffic.start()
        kill_times = []
        with Client(server.address, timeout=60) as client:
            for _ in range(kills):
                _wait(client, lambda c: c.health().status == "ok", "healthy executor")
                if standby == "on":
                    _wait(client, lambda c: "standby" in c.stats().host_rss_bytes, "standby")
                time.sleep(1.0)  # traffic flowing
                pid = client.health().executor_pid
                kill_times.append(time.monotonic())
                os.kill(pid, signal.SIGKILL)
                _wait(client, lambda c, old=pid: c.health().executor_pid not in (0, old), "restart")
            _wait(client, lambda c: c.health().status == "ok", "healthy executor")
            if standby == "on":  # the next standby's memory is the price: count it
                _wait(client, lambda c: "standby" in c.stats().host_rss_bytes, "standby")
            rss = client.stats().host_rss_bytes
        traffic.stopped.set()
        traffic.join(180)
        server.stop()
        done = [
            r for r in load(server.dir / "events.memlog").records if isinstance(r, RecoveryDone)
        ]
    return {
        "seconds": [r.seconds for r in done],
        "pauses": [traffic.pause_around(t) for t in kill_times],
        "errors": traffic.errors,
        "rss_mib": {name: round(b / 2**20) for name, b in rss.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--standby", choices=["on", "off", "both"], default="both")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=1)
    a = p.parse_args()
    model_args = ["--model", a.model, "--dtype", "float32", "--num-threads", str(a.num_threads)]
    for standby in ["off", "on"] if a.standby == "both" else [a.standby]:
        got = run(model_args, standby, a.kills)
        secs, pauses = got["seconds"], got["pauses"]
        print(
            f"standby {standby}: recovery s {[round(s, 2) for s in secs]} "
            f"median {statistics.median(secs):.2f}; client pause s "
            f"{[round(s, 2) for s in pauses]}; failed requests {len(got['errors'])}; "
            f"host RSS MiB {got['rss_mib']}",
            flush=True,
        )
        for err in got["errors"]:
            print(f"  error: {err}")


if __name__ == "__main__":
    main()
