"""Must-show 1 of issue 44: two replicas behind one front, one replica's core SIGKILLed in the
middle of 32 seeded streaming requests; all 32 complete with the tokens of a run without the
kill, the router's log replays, and a migration that drops the tokens sent is caught."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from router_helpers import differences, run_batch, running

from memstep.cli.main import main as memstep
from memstep.cli.serve import ServerProcess
from memstep.events.routing import ReplicaLost, RequestMigrated
from memstep.router.replay import load_router_log, replay_router

# replicas run 8 requests at a time, so that when the client has read KILL_AFTER tokens (it may
# lag the replicas on a busy machine) the replica killed still has requests running and waiting
KILL_AFTER = 64
BATCH = ["--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def front():
    """`memstep serve --data-parallel-size 2` with its HTTP front, as a user starts it."""
    flags = ["--model", "random:tiny", "--data-parallel-size", "2", *BATCH]
    with ServerProcess(flags, http=True) as p:
        p.wait_ready()
        yield p


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_killed_replica_costs_no_request_and_no_token(front):
    reference = run_batch(front.address)
    assert all(len(r[0]) == 48 and r[0] == r[1] for r in reference.values())
    victim = front.info["replicas"][0]["core_pid"]
    got = run_batch(front.address, kill_pid=victim, kill_after=KILL_AFTER)
    assert len(got) == 32 and differences(reference, got) == []
    log = load_router_log(front.info["router_log"])
    moved = [r for r in log.records if isinstance(r, RequestMigrated)]
    assert [r.replica for r in log.records if isinstance(r, ReplicaLost)] == [0]
    assert moved and any(0 < r.tokens_carried < 48 for r in moved)  # moved mid-stream
    body = json.dumps({"prompt": "over HTTP", "max_tokens": 4, "seed": 3}).encode()
    post = urllib.request.Request(
        front.http_url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(post, timeout=30) as reply:
        assert json.loads(reply.read())["usage"]["completion_tokens"] == 4
    status, body = _get(front.http_url + "/health")
    assert status == 200 and "1 of 2 replicas serve" in body
    status, metrics = _get(front.http_url + "/metrics")
    assert 'memstep:replica_live{replica="0"} 0.0' in metrics
    assert 'memstep:replica_live{replica="1"} 1.0' in metrics


def test_the_router_log_replays_and_inspect_lists_it(front, capsys):
    """After the kill above: every routing and migration decision replays; inspect lists the
    loss and each migration."""
    log = load_router_log(front.info["router_log"])
    checked, diverged = replay_router(log)
    assert diverged is None and checked >= 64 + 1
    assert memstep(["replay", front.info["router_log"]]) == 0
    capsys.readouterr()
    assert memstep(["inspect", front.info["router_log"]]) == 0
    text = capsys.readouterr().out
    moved = sum(isinstance(r, RequestMigrated) for r in log.records)
    assert "replica 0 lost at decision" in text and f"migrations: {moved}" in text


@pytest.mark.slow
def test_the_survivor_log_replays(front):
    """The survivor's own log, which took the migrated requests (RequestResumed mid-log),
    replays byte for byte (some 300 engine steps: slow on a shared machine)."""
    assert memstep(["replay", front.info["replica_logs"][1], "--disable-tqdm"]) == 0


def test_a_migration_without_the_tokens_sent_fails_the_check(replicas, tmp_path: Path):
    """Broken on purpose: the router resends a lost replica's requests without the tokens their
    clients have; their streams then repeat tokens, and the comparison catches it."""
    endpoints = [p.address for p in replicas]
    with running(endpoints, tmp_path / "r.memlog", debug_drop_sent_tokens=True) as router:
        reference = run_batch(router.endpoint)
        victim = replicas[0].info["core_pid"]
        got = run_batch(router.endpoint, kill_pid=victim, kill_after=KILL_AFTER)
    moved = [
        r
        for r in load_router_log(tmp_path / "r.memlog").records
        if isinstance(r, RequestMigrated) and r.tokens_carried > 0
    ]
    assert len(differences(reference, got)) == len(moved) > 0  # those that had tokens


def test_a_tampered_decision_is_a_divergence(front, tmp_path: Path):
    """The replay's check fires: a router log with one decision changed does not replay."""
    import attrs

    from memstep.events.log import LogWriter
    from memstep.events.routing import RequestRouted

    log = load_router_log(front.info["router_log"])
    records = list(log.records)
    i = next(k for k, r in enumerate(records) if isinstance(r, RequestRouted) and r.seq > 1)
    records[i] = attrs.evolve(records[i], replica=1 - records[i].replica)
    path = tmp_path / "tampered.memlog"
    header = {k: v for k, v in log.header.items() if k in ("kind", "router")}
    with LogWriter(path, header) as writer:
        for rec in records:
            writer.append(rec)
        writer.flush()
    checked, diverged = replay_router(load_router_log(path))
    assert diverged is not None and diverged.seq == records[i].seq
    assert memstep(["replay", str(path)]) == 1
