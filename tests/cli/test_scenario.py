"""`memstep scenario` end to end in a real subprocess: the table, the exit code, the flags."""

from __future__ import annotations

import subprocess
import sys


def scenario(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "memstep.cli.main", "scenario", *argv, "--no-record"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _rows(stdout: str) -> dict[str, list[str]]:
    return {
        line.split()[0]: line.split()
        for line in stdout.splitlines()
        if line.split() and line.split()[0] in ("spec", "no_spec")
    }


def test_clean_scenario_prints_the_table_and_exits_0():
    res = scenario("sampler-rise", "--steps", "24", "--model", "random:tiny")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "live start" in res.stdout and "verdict" in res.stdout
    row = _rows(res.stdout)["no_spec"]
    assert row[-1] == "ok" and row[5] == "0"  # growth 0


def test_planted_leak_prints_leak_and_exits_1():
    res = scenario(
        "sampler-rise", "--steps", "48", "--model", "random:tiny", "--plant-leak", "sampler_scratch"
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert _rows(res.stdout)["no_spec"][-1] == "LEAK"
    assert "leak: step" in res.stdout and "kind no_spec" in res.stdout


def test_speculation_flags_reach_the_scenario():
    res = scenario(
        "spec-disable",
        "--steps",
        "30",
        "--model",
        "random:tiny",
        "--speculative-method",
        "draft",
        "--draft-layers",
        "1",
        "--num-speculative-tokens",
        "2",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "speculative_method=draft" in res.stdout and "draft_layers=1" in res.stdout
    rows = _rows(res.stdout)
    assert rows["spec"][-1] == rows["no_spec"][-1] == "ok"
    assert int(rows["no_spec"][2]) >= 30  # steps run as no_spec
    bad = scenario("spec-disable", "--steps", "5", "--model", "random:tiny", "--draft-layers", "x")
    assert bad.returncode == 2 and "invalid int value" in bad.stderr
