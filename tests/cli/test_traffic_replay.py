"""`bench serve --dataset RUN.memlog`: a serve log's traffic, sent again to another config."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

import attrs
import pytest

from memstep.api.client import Client
from memstep.cli import bench_serve, traffic_replay
from memstep.cli.serve import ServerProcess
from memstep.cli.traffic_replay import load_recorded
from memstep.events.log import read_log
from memstep.events.types import RequestTimed
from memstep.replay.compare import compare
from memstep.replay.recording import load
from memstep.replay.replayer import replay

TINY = ["--model", "random:tiny", "--num-threads", "1"]
GAPS = [0.0, 0.3, 0.2, 0.4, 0.1]  # seconds between the recorded arrivals


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """A serve log of seeded sampled requests, arriving with the gaps above, and the timings
    each reply carried (the server's own measure)."""
    path = tmp_path_factory.mktemp("rec") / "run.memlog"
    with ServerProcess([*TINY, "--max-num-seqs", "8", "--record", str(path)]) as server:
        server.wait_ready()
        with Client(server.address, timeout=20) as client:
            streams = []
            for i, gap in enumerate(GAPS):
                time.sleep(gap)
                params = {"max_tokens": 12 + i, "temperature": 0.9, "seed": 100 + i}
                streams.append(client.generate(f"request {i}", stream=True, **params))
            for stream in streams:
                list(stream)
    return path, [stream.result.timing for stream in streams]


@pytest.fixture(scope="module")
def recorded_log(recorded_run):
    return recorded_run[0]


def test_the_log_gives_each_request_its_arrival_params_and_tokens(recorded_log):
    recorded = load_recorded(recorded_log)
    assert len(recorded) == len(GAPS)
    offsets = [r.offset_s for r in recorded]
    expected = [sum(GAPS[1 : i + 1]) for i in range(len(GAPS))]
    assert offsets == pytest.approx(expected, abs=0.1)  # as the client sent them
    assert [r.params["seed"] for r in recorded] == [100 + i for i in range(len(GAPS))]
    assert [len(r.token_ids) for r in recorded] == [12 + i for i in range(len(GAPS))]


def test_the_log_keeps_the_latencies_the_server_replied_with(recorded_run):
    path, timings = recorded_run
    recorded = load_recorded(path)
    logged = [(r.timed.ttft_s, r.timed.e2e_s, r.timed.queue_s) for r in recorded]
    assert logged == [(t.ttft_s, t.e2e_s, t.queue_s) for t in timings]
    assert all(0 < t.ttft_s < t.e2e_s for t in timings)
    first = recorded[0].latencies
    assert first["tpot"] == pytest.approx((first["e2el"] - first["ttft"]) / (12 - 1))


def test_the_timings_are_no_part_of_the_exact_replay(recorded_log):
    """`memstep replay` of the serve log stays identical: the server's wall-clock RequestTimed
    records are kept in the log but neither replayed nor compared."""
    recording = load(recorded_log)
    assert sum(isinstance(r, RequestTimed) for r in recording.records) == len(GAPS)
    assert not any(isinstance(r, RequestTimed) for r in recording.derived)
    run = replay(recording)
    assert not any(isinstance(r, RequestTimed) for r in run.records)
    assert compare(recording.derived, run.derived).is_identical


def test_replay_against_another_config_keeps_pace_and_completions(recorded_log, tmp_path, capsys):
    out, log = tmp_path / "replay.json", tmp_path / "replayed.memlog"
    argv = ["--dataset", str(recorded_log), "--json", str(out), *TINY, "--max-num-seqs", "2"]
    assert bench_serve.main([*argv, "--record", str(log)]) == 0
    # the replaying server's own log: each request arrived near its recorded offset (well inside
    # the 100 ms shortest gap: a replay that sent in a burst would be 0.3-1.0 s off), and was
    # given the recorded tokens, under a config the recording did not have. The tolerances are
    # the scheduler's wake-up lateness on a loaded 2-core machine (26 ms seen in CI), not a pace.
    recorded, again = load_recorded(recorded_log), load_recorded(log)
    assert [a.offset_s for a in again] == pytest.approx([r.offset_s for r in recorded], abs=0.08)
    assert [a.token_ids for a in again] == [r.token_ids for r in recorded]
    assert read_log(log)[0]["config"]["max_num_seqs"] == 2
    data = json.loads(out.read_text())
    assert (data["requests"], data["failed"]) == (len(GAPS), 0)
    assert data["max_lag_ms"] < 80.0  # each request left well inside a gap of its recorded offset
    assert data["identical"] == data["compared"] == len(GAPS)
    latency = data["latency"]
    assert latency["requests"] == len(GAPS)
    ttfts = sorted(r.timed.ttft_s * 1000 for r in recorded)
    assert latency["ttft_recorded_ms"]["median"] == pytest.approx(ttfts[len(GAPS) // 2])
    for name in ("ttft", "tpot", "e2el"):  # the replay's own, measured afresh
        assert latency[f"{name}_replayed_ms"]["median"] > 0
        assert latency[f"{name}_replayed_ms"] != latency[f"{name}_recorded_ms"]
    captured = capsys.readouterr()
    assert re.search(rf"traffic replay: 100%\|[^|]*\| {len(GAPS)}/{len(GAPS)} \[", captured.err)
    printed = captured.out
    assert "Traffic Replay Result" in printed and "Identical completions" in printed
    table = printed[printed.index("Server latency (ms)") :]
    assert "recorded" in table and "replayed" in table
    for row in ("Median TTFT", "P99 TPOT", "Mean E2EL"):
        assert row in table, table


def test_a_changed_seed_is_caught(recorded_log, tmp_path):
    """The identity check fires: the same log with one seed changed is no longer identical."""
    recorded = load_recorded(recorded_log)
    changed = [attrs.evolve(recorded[0], params={**recorded[0].params, "seed": 7}), *recorded[1:]]
    with ServerProcess(TINY) as server:
        server.wait_ready()
        results, duration = asyncio.run(traffic_replay.replay(server.address, changed, 4.0, 20))
    data = traffic_replay.summary(recorded, results, duration)
    assert data["identical"] == len(GAPS) - 1
    # --speed 4: the recorded second of arrivals is sent in a quarter of it, each on time
    assert recorded[-1].offset_s / 4 <= duration < recorded[-1].offset_s
    assert data["max_lag_ms"] < 80.0  # wake-up lateness on a loaded machine, as above


@pytest.mark.parametrize("flags", [["--backend", "openai"], ["--base-url", "http://127.0.0.1:1"]])
def test_a_log_over_http_is_a_one_line_error(recorded_log, flags):
    cmd = [sys.executable, "-m", "memstep.cli.main", "bench", "serve", "--dataset", recorded_log]
    res = subprocess.run([*map(str, cmd), *flags], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("memstep: error: --dataset RUN.memlog")
