"""`bench serve --dataset RUN.memlog`: a serve log's traffic, sent again to another config."""

from __future__ import annotations

import asyncio
import json
import time

import attrs
import pytest

from memstep.api.client import Client
from memstep.cli import bench_serve, traffic_replay
from memstep.cli.serve import ServerProcess
from memstep.cli.traffic_replay import load_recorded

TINY = ["--model", "random:tiny", "--num-threads", "1"]
GAPS = [0.0, 0.3, 0.2, 0.4, 0.1]  # seconds between the recorded arrivals


@pytest.fixture(scope="module")
def recorded_log(tmp_path_factory):
    """A serve log of seeded sampled requests, arriving with the gaps above."""
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
    return path


def test_the_log_gives_each_request_its_arrival_params_and_tokens(recorded_log):
    recorded = load_recorded(recorded_log)
    assert len(recorded) == len(GAPS)
    offsets = [r.offset_s for r in recorded]
    expected = [sum(GAPS[1 : i + 1]) for i in range(len(GAPS))]
    assert offsets == pytest.approx(expected, abs=0.1)  # as the client sent them
    assert [r.params["seed"] for r in recorded] == [100 + i for i in range(len(GAPS))]
    assert [len(r.token_ids) for r in recorded] == [12 + i for i in range(len(GAPS))]


def test_replay_against_another_config_keeps_pace_and_completions(recorded_log, tmp_path, capsys):
    out = tmp_path / "replay.json"
    argv = ["--dataset", str(recorded_log), "--json", str(out), *TINY, "--max-num-seqs", "2"]
    assert bench_serve.main(argv) == 0
    data = json.loads(out.read_text())
    assert (data["requests"], data["failed"]) == (len(GAPS), 0)
    assert data["max_lag_ms"] < 20.0  # each request left within 20 ms of its recorded offset
    assert data["identical"] == data["compared"] == len(GAPS)
    printed = capsys.readouterr().out
    assert "Traffic Replay Result" in printed and "Identical completions" in printed


def test_a_changed_seed_is_caught(recorded_log, tmp_path):
    """The identity check fires: the same log with one seed changed is no longer identical."""
    recorded = load_recorded(recorded_log)
    changed = [attrs.evolve(recorded[0], params={**recorded[0].params, "seed": 7}), *recorded[1:]]
    with ServerProcess(TINY) as server:
        server.wait_ready()
        results, duration = asyncio.run(traffic_replay.replay(server.address, changed, 4.0, 20))
    data = traffic_replay.summary(recorded, results, duration)
    assert data["identical"] == len(GAPS) - 1
