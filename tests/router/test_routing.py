"""Must-show 2 of issue 44: prefix routing keeps requests that share a long system prompt on
one replica and its prefix cache hits more than round-robin's; a test per policy."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from router_helpers import running

from memstep.api.client import AsyncClient, Client
from memstep.events.routing import RequestRouted
from memstep.router.policy import NoReplica, Policy
from memstep.router.prefix import block_hashes
from memstep.router.replay import load_router_log, replay_router


def system_prompt(topic: str) -> str:
    """About 320 characters (random:tiny reads bytes: 320 tokens), distinct per topic."""
    words = [f"{topic}{i % 7}" for i in range(40)]
    return ("You are a careful assistant about " + " ".join(words))[:320]


def _sequential(endpoint: str, system: str, n: int = 8) -> tuple[float, int]:
    """`n` requests sharing `system`, one after another: (prefix cache hit rate, prompt tokens)."""
    cached = prompt = 0
    with Client(endpoint) as client:
        for i in range(n):
            done = client.generate(f"{system}\nQuestion {i}: why?", max_tokens=4, seed=i)
            cached += done.usage.cached_tokens
            prompt += done.usage.prompt_tokens
    return cached / prompt, prompt


def _routed(log: Path) -> list[RequestRouted]:
    return [r for r in load_router_log(log).records if isinstance(r, RequestRouted)]


def test_prefix_routing_keeps_a_system_prompt_on_one_replica_and_beats_round_robin(
    replicas, tmp_path: Path
):
    endpoints = [p.address for p in replicas]
    with running(endpoints, tmp_path / "prefix.memlog", policy="prefix") as router:
        prefix_rate, _ = _sequential(router.endpoint, system_prompt("alpha"))
    with running(endpoints, tmp_path / "rr.memlog", policy="round-robin") as router:
        rr_rate, _ = _sequential(router.endpoint, system_prompt("beta"))
    routed = _routed(tmp_path / "prefix.memlog")
    assert len({r.replica for r in routed}) == 1
    assert [r.reason for r in routed] == ["load"] + ["prefix"] * 7
    assert len({r.replica for r in _routed(tmp_path / "rr.memlog")}) == 2
    assert prefix_rate > rr_rate > 0
    for log in ("prefix.memlog", "rr.memlog"):
        assert replay_router(load_router_log(tmp_path / log)) == (8, None)


def test_load_routing_sends_each_request_to_the_least_loaded(replicas, tmp_path: Path):
    async def burst(endpoint: str) -> None:
        async with AsyncClient(endpoint) as client:
            jobs = [
                client.generate(f"load {i} " * (1 + 10 * (i % 3)), max_tokens=8, seed=i)
                for i in range(12)
            ]
            await asyncio.gather(*jobs)

    endpoints = [p.address for p in replicas]
    with running(endpoints, tmp_path / "load.memlog", policy="load") as router:
        asyncio.run(burst(router.endpoint))
    routed = _routed(tmp_path / "load.memlog")
    assert len(routed) == 12 and {r.replica for r in routed} == {0, 1}
    for r in routed:
        assert r.loads[r.replica] == min(r.loads), r
    assert replay_router(load_router_log(tmp_path / "load.memlog")) == (12, None)


def test_round_robin_takes_the_replicas_in_turn(replicas, tmp_path: Path):
    endpoints = [p.address for p in replicas]
    with running(endpoints, tmp_path / "rr.memlog", policy="round-robin") as router:
        _sequential(router.endpoint, system_prompt("gamma"), n=6)
    assert [r.replica for r in _routed(tmp_path / "rr.memlog")] == [0, 1, 0, 1, 0, 1]


def test_prefix_gives_way_to_load_past_the_balance():
    policy = Policy("prefix", 2, balance_tokens=100)
    hashes = block_hashes("x" * 640)
    start = policy.choose(hashes, [0, 0], [True, True])
    assert start.reason == "load"
    first = start.replica
    again = policy.choose(hashes, [0, 0], [True, True])
    assert (again.replica, again.reason, again.matched_blocks) == (first, "prefix", 10)
    loads = [0, 0]
    loads[first] = 101  # past the balance: the cached replica is passed over
    choice = policy.choose(hashes, loads, [True, True])
    assert (choice.replica, choice.reason) == (1 - first, "load")
    with pytest.raises(NoReplica):
        policy.choose(hashes, [0, 0], [False, False])


def test_a_lost_replica_is_never_chosen():
    policy = Policy("round-robin", 3)
    picks = [policy.choose([], [0, 0, 0], [True, False, True]).replica for _ in range(4)]
    assert picks == [0, 2, 0, 2]


def test_a_replica_elsewhere_is_reached_over_curve_and_a_stranger_is_not(tmp_path: Path):
    """`--replica` with CURVE: the router's key pair is allowed by the replica; a router with
    another key pair is refused, and the replica never counts as live for it."""
    import zmq

    from memstep.cli.serve import ServerProcess
    from memstep.router.router import Router, RouterConfig

    server_public, server_secret = zmq.curve_keypair()
    router_public, router_secret = zmq.curve_keypair()
    stranger_public, stranger_secret = zmq.curve_keypair()
    (tmp_path / "server.key").write_bytes(server_secret)
    flags = [
        "--model",
        "random:tiny",
        "--curve-secret-key",
        str(tmp_path / "server.key"),
        "--curve-client-keys",
        router_public.decode(),
    ]
    with ServerProcess(flags) as replica:
        replica.wait_ready()
        curve = (server_public, router_public, router_secret)
        with running([replica.address], tmp_path / "c.memlog", replica_curve=curve) as router:
            with Client(router.endpoint) as client:
                done = client.generate("over curve", max_tokens=4, seed=1)
            assert len(done.token_ids) == 4
        cfg = RouterConfig(replica_curve=(server_public, stranger_public, stranger_secret))
        refused = Router([replica.address], cfg)
        try:
            assert not refused.wait_live(2.0)
        finally:
            refused.close()


def test_a_bad_request_is_refused_by_its_replica_and_the_router_goes_on(replicas, tmp_path: Path):
    from memstep.api.client import ServerError

    endpoints = [p.address for p in replicas]
    with running(endpoints, tmp_path / "bad.memlog") as router, Client(router.endpoint) as client:
        with pytest.raises(ServerError) as refused:
            client.generate("a bad seed", max_tokens=2, seed="not a number")
        assert refused.value.code == "invalid_request", refused.value
        assert len(client.generate("a good one", max_tokens=2, seed=1).token_ids) == 2


def test_tokenize_is_answered_by_a_replica_through_the_router(replicas, tmp_path: Path):
    from memstep.api.client import ServerError

    endpoints = [p.address for p in replicas]
    with running(endpoints, tmp_path / "tok.memlog") as router, Client(router.endpoint) as client:
        with Client(endpoints[0]) as direct:
            expected = direct.tokenize("hello there").token_ids
        got = client.tokenize("hello there")
        assert got.token_ids == expected and got.max_model_len > 0
        assert client.detokenize(expected) == direct_text(endpoints[0], expected)
        with pytest.raises(ServerError) as refused:
            client.detokenize([10**9])
        assert refused.value.code == "invalid_request"


def direct_text(endpoint: str, ids: list[int]) -> str:
    with Client(endpoint) as direct:
        return direct.detokenize(ids)


def test_replicas_of_different_weights_are_refused(replicas, tmp_path: Path):
    """Migration continues a stream exactly only on the same weights: a replica with another
    weights seed makes the check fire, the same ones pass it."""
    from memstep.cli.serve import ServerProcess
    from memstep.cli.serve_replicas import check_same_model
    from memstep.core.config import ConfigError

    flags = ["--model", "random:tiny", "--random-weights-seed", "7"]
    with ServerProcess(flags) as other:
        other.wait_ready()
        same = [p.address for p in replicas]
        with running(same, tmp_path / "same.memlog") as router:
            check_same_model(router.models())
        mixed = [same[0], other.address]
        with (
            running(mixed, tmp_path / "mixed.memlog") as router,
            pytest.raises(ConfigError, match="different models"),
        ):
            check_same_model(router.models())


def test_a_local_replica_takes_the_engine_flags_and_not_the_routers():
    import argparse

    from memstep.cli import serve, serve_replicas

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    given = "--data-parallel-size 2 --model random:tiny --port 7000 --max-num-seqs 8 "
    given += "--no-enable-prefix-caching --api-key k --debug-kill-executor-at 5,9 "
    args = p.parse_args((given + "--routing-policy load").split())
    argv = serve_replicas.replica_argv(args, p)
    assert argv[:2] == ["--model", "random:tiny"] and "--no-enable-prefix-caching" in argv
    assert argv[argv.index("--max-num-seqs") + 1] == "8"
    assert argv[argv.index("--debug-kill-executor-at") + 1] == "5,9"
    routers = {"--port", "--api-key", "--data-parallel-size", "--routing-policy", "--record"}
    assert not routers & set(argv)
    assert p.parse_args(argv).max_num_seqs == 8  # serve reads it back


def test_the_logs_of_a_run_lie_together_and_old_runs_are_pruned(tmp_path: Path, monkeypatch):
    from memstep.cli.serve_replicas import log_paths
    from memstep.replay.recorder import DEFAULT_RECORD_PATH

    monkeypatch.chdir(tmp_path)
    old = tmp_path / "memstep-logs"
    old.mkdir()
    for name in ("memstep-20260101-000000", "memstep-20260102-000000"):
        for suffix in (".memlog", ".replica0.memlog", ".replica1.memlog"):
            (old / (name + suffix)).write_bytes(b"")
    router, replicas = log_paths(DEFAULT_RECORD_PATH, 2, keep=2)  # this run and the newest one
    assert router is not None and replicas == [
        router.with_name(router.name.replace(".memlog", f".replica{i}.memlog")) for i in (0, 1)
    ]
    left = sorted(p.name for p in old.iterdir())
    assert left == [
        f"memstep-20260102-000000{s}" for s in (".memlog", ".replica0.memlog", ".replica1.memlog")
    ]
    assert log_paths(None, 2) == (None, [None, None])
