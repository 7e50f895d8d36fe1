"""`memstep inspect` and `memstep plot` on the real-model logs."""

from __future__ import annotations

import json

import matplotlib.image
import numpy as np
from replay_helpers import memstep

from memstep.events.types import StateEntered, StepFinished
from memstep.replay.recording import load


def test_inspect_json_adds_up_the_log(smol_log):
    code, out, _ = memstep("inspect", str(smol_log.path), "--json")
    assert code == 0
    s = json.loads(out)
    records = load(smol_log.path).records
    steps = [r for r in records if isinstance(r, StepFinished)]
    work = smol_log.workload
    recorded = s["log"]["header"]["config"]
    assert isinstance(recorded["seed"], int)  # the engine-wide seed, drawn at start
    assert recorded == smol_log.cfg.replace(seed=recorded["seed"]).to_dict()
    assert s["log"]["problem"] is None
    assert s["requests"]["num_added"] == s["requests"]["num_finished"] == work.num_requests
    assert s["requests"]["reasons"]["abort"] == len(work.aborted)
    assert s["num_steps"] == len(steps) == sum(k["num_steps"] for k in s["kinds"].values())
    assert s["kinds"]["spec"]["num_steps"] == sum(st.kind == "spec" for st in steps) > 0
    assert s["num_proposed"] == sum(st.num_proposed for st in steps) > 0
    assert len(s["transitions"]) == sum(isinstance(r, StateEntered) for r in records)
    assert {(t["source"], t["target"]) for t in s["transitions"]} == {
        ("profile", "warmup"),
        ("warmup", "capture"),
        ("capture", "no_spec"),
        ("no_spec", "spec"),
        ("spec", "no_spec"),
    }
    assert set(s["ledger"]) == {"warmup", "capture", "no_spec", "spec"}
    assert all(k["claimed"] == k["released"] for k in s["ledger"].values()), s["ledger"]
    assert s["ledger"]["warmup"]["claimed"] > 0 and s["ledger"]["warmup"]["num_exits"] == 1
    assert s["host_rss"]["executor"]["peak"] > 0
    stretches = s["stretches"]
    assert sum(st["num_steps"] for st in stretches) == len(steps)
    assert all(a["kind"] != b["kind"] for a, b in zip(stretches, stretches[1:], strict=False))
    assert s["kinds"]["no_spec"]["growth"] == 0 and s["leaks"] == []
    assert s["peak_arena_claimed_bytes"] > 0 and s["peak_kv_pages_used"] > 0


def test_inspect_shows_the_leak_and_its_growth(leak_log):
    code, text, _ = memstep("inspect", str(leak_log.path))
    assert code == 0
    for heading in ("requests:", "steps:", "transitions:", "memory growth per kind", "stretches"):
        assert heading in text
    assert "leak reports: " in text and "leak reports: none" not in text
    assert "no_spec live_growth" in text and "B/step" in text  # its rate
    s = json.loads(memstep("inspect", str(leak_log.path), "--json")[1])
    no_spec = s["kinds"]["no_spec"]
    assert no_spec["growth"] > 0 and no_spec["max_growth"] > 0
    grown = [st for st in s["stretches"] if st["growth"] > 0]
    assert grown and all(st["kind"] == "no_spec" for st in grown)
    assert all(st["growth"] == st["live_end"] - st["live_start"] for st in s["stretches"])


def red_pixels(png) -> int:
    """Pixels of the pure red the leak markers are drawn in."""
    rgb = matplotlib.image.imread(png)[..., :3]
    return int(np.sum((rgb[..., 0] > 0.9) & (rgb[..., 1] < 0.15) & (rgb[..., 2] < 0.15)))


def test_plot_writes_the_memory_timeline(smol_log, leak_log, tmp_path):
    clean, leaky = tmp_path / "mem.png", tmp_path / "leak.png"
    for log, png in ((smol_log, clean), (leak_log, leaky)):
        code, out, err = memstep("plot", str(log.path), "-o", str(png))
        assert code == 0, err
        assert out.strip() == f"wrote {png}"
        assert png.stat().st_size > 30_000
        assert matplotlib.image.imread(png).shape == (900, 1200, 4)
    assert red_pixels(clean) == 0 and red_pixels(leaky) > 50


def test_inspect_piped_into_a_reader_that_stops_early_exits_quietly(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "short.memlog"
    argv = ["--model", "random:tiny", "--raw", "--prompt", "hi", "--max-tokens", "3"]
    assert memstep("generate", *argv, "--record", str(path))[0] == 0
    cmd = [sys.executable, "-m", "memstep.cli.main", "inspect", str(path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before the first line is written (`| head -0`)
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert proc.returncode == 141
