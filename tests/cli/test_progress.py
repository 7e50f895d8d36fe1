"""Progress with an ETA on stderr for `replay`, `scenario` and `bench offline`, and none with
`--disable-tqdm`: the real CLI in a subprocess, on the tiny random model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TINY = ["--model", "random:tiny", "--num-threads", "1"]
# a finished tqdm bar: "desc: 100%|####| N/N [elapsed<remaining, rate unit/s]"
FULL_BAR = r"100%\|[^|]*\| (\d+)/\1 \[[\d:]+<[\d:]+, *[\d.]+{unit}/s\]"


def memstep(*argv: str | Path) -> tuple[int, str, str]:
    cmd = [sys.executable, "-m", "memstep.cli.main", *map(str, argv)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return res.returncode, res.stdout, res.stderr


def bar(err: str, desc: str, unit: str) -> re.Match | None:
    return re.search(re.escape(desc) + ": *" + FULL_BAR.format(unit=unit), err)


@pytest.fixture(scope="module")
def tiny_log(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("log") / "run.memlog"
    argv = ["generate", *TINY, "--max-tokens", "6", "--prompt", "hello", "--record", path]
    code, _, err = memstep(*argv)
    assert code == 0, err
    return path


@pytest.mark.parametrize("quiet", [False, True])
def test_replay_shows_its_steps(tiny_log, quiet):
    code, out, err = memstep("replay", tiny_log, *(["--disable-tqdm"] * quiet))
    assert code == 0, err
    found = bar(err, "replay", "step")
    assert (found is None) == quiet, err
    assert "replay:" not in err if quiet else int(found.group(1)) >= 6  # a step per token
    assert "replay:" not in out  # the report alone on stdout


@pytest.mark.parametrize("quiet", [False, True])
def test_scenario_shows_its_steps(quiet):
    argv = ["scenario", "sampler-rise", "--steps", "16", *TINY[:2], "--no-record"]
    code, out, err = memstep(*argv, *(["--disable-tqdm"] * quiet))
    assert code == 0, err
    # the bar's total is the steps the scenario drives; the drain after them may add a few
    shown = [int(n) for n in re.findall(r"sampler-rise: *\d+%\|[^|]*\| (\d+)/16 \[", err)]
    assert (not shown) == quiet, err
    assert quiet or shown[-1] >= 16
    assert "verdict" in out


@pytest.mark.parametrize("quiet", [False, True])
def test_bench_offline_shows_its_requests(quiet):
    argv = ["bench", "offline", *TINY, "--skip-hf", "--num-single", "2", "--num-prompts", "3"]
    argv += ["--dataset", "synthetic", "--max-output-len", "8"]
    code, out, err = memstep(*argv, *(["--disable-tqdm"] * quiet))
    assert code == 0, err
    single, batch = bar(err, "(a) memstep", "req"), bar(err, "(b) memstep", "req")
    if quiet:
        assert single is None and batch is None and "memstep:" not in err, err
    else:
        assert single and batch, err
        assert (single.group(1), batch.group(1)) == ("2", "3")
    assert "(b) 3 synthetic" in out
