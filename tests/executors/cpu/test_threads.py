"""The OpenMP wait policy reaches the executor before torch does, and a user's choice wins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memstep.core.config import EngineConfig
from memstep.core.engine import Engine
from memstep.executors.cpu.threads import (
    PASSIVE,
    SPIN_COUNT,
    WAIT_POLICY,
    executor_env,
    threads_sleep_when_idle,
)
from memstep.executors.process.remote import ProcessExecutor

POLICY_AFTER = """
import os, sys
{before}
from memstep.executors.cpu.threads import prefer_passive_wait
prefer_passive_wait()
print(os.environ.get("OMP_WAIT_POLICY"))
"""


def policy_after(before: str, env: dict[str, str]) -> str:
    code = POLICY_AFTER.format(before=before)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_executor_env_adds_a_passive_policy_unless_one_is_named():
    assert executor_env({"PATH": "/bin"}) == {"PATH": "/bin", WAIT_POLICY: PASSIVE}
    assert executor_env({WAIT_POLICY: "ACTIVE"})[WAIT_POLICY] == "ACTIVE"


@pytest.mark.parametrize(
    ("env", "asleep"),
    [
        ({WAIT_POLICY: PASSIVE}, True),
        ({WAIT_POLICY: "passive "}, True),
        ({}, False),
        ({WAIT_POLICY: "ACTIVE"}, False),
        ({WAIT_POLICY: PASSIVE, SPIN_COUNT: "20000"}, False),  # libgomp takes the count
        ({SPIN_COUNT: "0"}, True),
    ],
)
def test_the_kernels_know_whether_the_pool_sleeps_between_regions(env, asleep):
    assert threads_sleep_when_idle(env) is asleep


@pytest.mark.parametrize(
    ("before", "given", "expected"),
    [("", None, PASSIVE), ("", "ACTIVE", "ACTIVE"), ("import torch", None, "None")],
    ids=["fresh", "user-choice", "torch-already-loaded"],
)
def test_prefer_passive_wait_only_before_torch_loads(before, given, expected):
    env = {k: v for k, v in os.environ.items() if k != WAIT_POLICY}
    if given is not None:
        env[WAIT_POLICY] = given
    assert policy_after(before, env) == expected


def test_the_executor_process_starts_with_a_passive_policy(monkeypatch):
    monkeypatch.delenv(WAIT_POLICY, raising=False)
    engine = Engine(EngineConfig(model="random:tiny", num_threads=1), ProcessExecutor)
    try:
        environ = Path(f"/proc/{engine.executor.proc.pid}/environ").read_bytes().split(b"\0")
    finally:
        engine.shutdown()
    assert f"{WAIT_POLICY}={PASSIVE}".encode() in environ


def test_small_work_runs_on_one_thread_only_where_the_pool_sleeps(monkeypatch):
    import torch

    from memstep.executors.cpu.threads import small_work

    monkeypatch.delenv(SPIN_COUNT, raising=False)
    before = torch.get_num_threads()
    monkeypatch.setenv(WAIT_POLICY, PASSIVE)
    with small_work(cpu=True):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with small_work(cpu=False):
        assert torch.get_num_threads() == before  # CUDA's work is not on this pool
    monkeypatch.setenv(WAIT_POLICY, "ACTIVE")
    with small_work(cpu=True):
        assert torch.get_num_threads() == before
