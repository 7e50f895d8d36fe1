"""`--api-server-count N`: N HTTP front processes accept on the one port, each a ZMQ client of
the core; streamed requests over many connections all finish, and stopping the server ends them."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import httpx

from memstep.cli.serve import ServerProcess, front_count
from memstep.serving.http_front.http_front import default_front_count
from memstep.serving.http_front.metrics import TOKEN_BUCKETS

TINY = ["--model", "random:tiny", "--num-threads", "1"]


async def streams(url: str, n: int) -> list[str]:
    """`n` streamed completions, each on a connection of its own."""

    async def one(i: int) -> str:
        async with httpx.AsyncClient(timeout=120) as http:
            model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
            body = {"model": model, "prompt": f"p{i}", "max_tokens": 6, "ignore_eos": True}
            reply = await http.post(f"{url}/v1/completions", json={**body, "stream": True})
            assert reply.status_code == 200
            return reply.text

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_two_fronts_share_the_port_and_serve():
    with ServerProcess([*TINY, "--api-server-count", "2"], http=True) as server:
        info = server.wait_ready()
        pids = info["http_pids"]
        assert len(set(pids)) == 2 and all(alive(pid) for pid in pids)
        texts = asyncio.run(streams(server.http_url, 8))
        assert all(
            t.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in t for t in texts
        )
        server.stop()
        for pid in pids:  # the children end with the server (reaped by it, then gone)
            for _ in range(50):
                if not alive(pid):
                    break
                asyncio.run(asyncio.sleep(0.1))
            assert not alive(pid)


def test_zero_fronts_is_a_one_line_error():
    with ServerProcess([*TINY, "--api-server-count", "0"], http=True) as server:
        server.proc.wait(60)
        assert server.proc.returncode == 2, server.log()
        assert "api_server_count must be >= 1" in server.log()


def test_auto_is_two_fronts_on_a_gpu_host_with_cpus_to_spare_else_one():
    assert default_front_count(on_gpu=True, num_cpus=16) == 2
    assert default_front_count(on_gpu=True, num_cpus=4) == 1  # the cores go to core and executor
    assert default_front_count(on_gpu=False, num_cpus=64) == 1
    assert front_count("auto", "cpu") == 1  # a CPU device: no GPU asked of nvidia-smi
    assert front_count(3, "cuda") == 3  # a count given wins


E2E_COUNT = re.compile(r"^memstep:e2e_request_latency_seconds_count (\S+)$", re.M)


def e2e_count(url: str) -> float:
    """The end-to-end latency histogram's count in one scrape of `/metrics`."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    (count,) = E2E_COUNT.findall(text)
    return float(count)


def test_the_latency_histograms_of_two_fronts_are_merged():
    """One front answers 4 requests while the other is stopped (SIGSTOP: it accepts nothing);
    then the other alone answers the scrape, and counts them."""
    with ServerProcess([*TINY, "--api-server-count", "2"], http=True) as server:
        first, second = server.wait_ready()["http_pids"]
        url = server.http_url
        os.kill(second, signal.SIGSTOP)
        try:
            asyncio.run(streams(url, 4))
        finally:
            os.kill(second, signal.SIGCONT)
        os.kill(first, signal.SIGSTOP)
        try:
            assert e2e_count(url) == 4
        finally:
            os.kill(first, signal.SIGCONT)


HISTOGRAM_IN_A_PROCESS = """
import sys
from memstep.serving.http_front.metrics import Metrics
m = Metrics()
if sys.argv[1] == "observe":
    m.e2e.observe(0.5)
print(m.exposition(None).decode())
"""


def count_seen_by_another_process(env: dict) -> float:
    """One process observes a latency, a second one scrapes: the count the second one shows."""
    for what in ("observe", "scrape"):
        run = [sys.executable, "-c", HISTOGRAM_IN_A_PROCESS, what]
        out = subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout
    (count,) = E2E_COUNT.findall(out)
    return float(count)


def test_without_the_shared_folder_a_front_sees_only_its_own_latencies(tmp_path):
    """What the merge fixes, shown on purpose: two processes' histograms are apart unless they
    share the multiprocess folder."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    assert count_seen_by_another_process(env) == 0
    shared = {**env, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    assert count_seen_by_another_process(shared) == 1


GAPS_IN_A_PROCESS = """
import os, random
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from memstep.serving.http_front.metrics import TOKEN_BUCKETS, observe_all
rng = random.Random(0)
gaps = [rng.expovariate(1 / 0.03) for _ in range(300)] + [0.001, 0.0025, 2.5, 99.0, 0.0]
shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
registry = CollectorRegistry()
own = None if shared else registry
if shared:
    MultiProcessCollector(registry, shared)
one, together = (Histogram(n, n, buckets=TOKEN_BUCKETS, registry=own) for n in ("one", "all"))
for gap in gaps:
    one.observe(gap)
observe_all(together, gaps)
print(generate_latest(registry).decode())
"""


def test_a_request_s_gaps_observed_at_once_read_as_observed_one_by_one(tmp_path):
    """`observe_all` (one update a bucket for a request's hundreds of inter-token gaps) gives
    the exposition of one `observe` a gap, in one front and in the shared folder of several."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    for mode in (env, {**env, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}):
        run = [sys.executable, "-c", GAPS_IN_A_PROCESS]
        out = subprocess.run(run, env=mode, capture_output=True, text=True, check=True).stdout
        lines = [ln for ln in out.splitlines() if not ln.startswith("#") and "_created" not in ln]
        one = sorted(ln.removeprefix("one") for ln in lines if ln.startswith("one"))
        together = sorted(ln.removeprefix("all") for ln in lines if ln.startswith("all"))
        assert one == together and len(one) == len(TOKEN_BUCKETS) + 3, out  # +Inf, count, sum
