"""What a new user meets first: --version, one-line usage errors, mistakes caught before the model
loads, help that fits a screen, and --config files recorded in the log header."""

from __future__ import annotations

import contextlib
import io
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from memstep.cli import serve
from memstep.cli.main import main
from memstep.core.config import EngineConfig
from memstep.core.model_config import PRESETS
from memstep.events.version import VERSION
from memstep.replay.recorder import prune
from memstep.replay.recording import load

MEMSTEP = [sys.executable, "-m", "memstep.cli.main"]
TINY = ["--model", "random:tiny", "--num-threads", "1"]


def _run(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    out = subprocess.run([*MEMSTEP, *args], capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - start


def _help(*args: str) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(list(args))
    return out.getvalue().splitlines()


def test_version():
    out, _ = _run("--version")
    assert (out.returncode, out.stdout.strip()) == (0, f"memstep {VERSION}")


@pytest.mark.parametrize(
    "args", [["generate", "--temperature", "abc"], ["serve", "--port", "x"], ["nonsense"], []]
)
def test_a_usage_mistake_is_one_line_and_a_pointer_to_help(args):
    out, _ = _run(*args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and 1 <= len(lines) <= 3, out.stderr
    assert "error:" in lines[0] and "--help" in lines[-1]


def test_a_busy_zmq_port_fails_before_smollm2_loads():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        out, took = _run("--log-level", "info", "serve", "--zmq-port", str(port), "--port", "0")
    assert out.returncode == 2 and "Address already in use" in out.stderr
    assert "memory plan" not in out.stderr  # no executor started loading the model
    assert took < 2.0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--max-tokens", "5000"], "exceeds the context of 2048 tokens"),
    ],
)
def test_bad_sampling_values_fail_before_the_model_loads(flags, message):
    out, took = _run(
        "--log-level", "info", "generate", "--prompt", "hi", "--model", "smollm2", *flags
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines == [
        f"memstep: error: {lines[0][len('memstep: error: ') :]}"
    ]
    assert message in lines[0] and "memory plan" not in out.stderr
    if "temperature" in message:
        assert took < 2.0  # no model file read at all


def test_serve_help_fits_a_screen_and_help_all_shows_the_rest():
    short, full = _help("serve", "--help"), _help("serve", "--help-all")
    assert len(short) < 80, len(short)
    assert "--debug-kill-executor-at" not in "\n".join(short)
    assert "--debug-kill-executor-at" in "\n".join(full) and len(full) > len(short)
    assert [line for line in short if line.count("(default:") > 1] == []
    titles = [
        line
        for line in full
        if line.rstrip(":") in ("common", "performance", "distributed", "debugging")
    ]
    assert titles == ["common:", "performance:", "distributed:", "debugging:"]
    assert "examples:" in short


def test_the_top_level_help_names_tasks():
    text = "\n".join(_help("--help"))
    assert "memstep chat" in text and "memstep serve" in text


def _header_config(path: Path) -> dict:
    return load(path).config


def test_a_config_file_records_the_same_config_as_the_flags(tmp_path):
    values = {"model": "random:tiny", "num-threads": 1, "block_size": 8, "num-kv-blocks": 40}
    values |= {"seed": 5, "enable_prefix_caching": False, "max-tokens": 2, "prompt": "hello"}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    from_file, from_flags = tmp_path / "file.memlog", tmp_path / "flags.memlog"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["generate", "--config", str(path), "--record", str(from_file)]) == 0
        flags = [*TINY, "--block-size", "8", "--num-kv-blocks", "40", "--seed", "5"]
        flags += ["--no-enable-prefix-caching", "--max-tokens", "2", "--prompt", "hello"]
        assert main(["generate", *flags, "--record", str(from_flags)]) == 0
    header = load(from_file).header
    assert header["config_file"] == {"path": str(path), "values": values}
    assert header["config"] == load(from_flags).header["config"]
    assert header["config"]["block_size"] == 8 and not header["config"]["enable_prefix_caching"]


def test_the_command_line_wins_over_the_file_and_a_bad_key_is_one_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model: random:tiny\nnum-threads: 1\nblock-size: 8\nmax-tokens: 2\n")
    log = tmp_path / "x.memlog"
    with contextlib.redirect_stdout(io.StringIO()):
        argv = ["generate", "--config", str(path), "--block-size", "32", "--prompt", "hi"]
        assert main([*argv, "--record", str(log)]) == 0
    assert load(log).config["block_size"] == 32
    path.write_text("model: random:tiny\nblock-sise: 8\n")
    assert main(["generate", "--config", str(path), "--prompt", "hi"]) == 2
    assert "no flag 'block-sise'" in capsys.readouterr().err


def test_the_default_log_directory_keeps_the_newest(tmp_path, monkeypatch):
    logs = tmp_path / "memstep-logs"
    logs.mkdir()
    names = [f"memstep-20260101-0000{i:02d}.memlog" for i in range(25)]
    for name in names:
        (logs / name).write_bytes(b"x")
    (logs / (names[0] + ".1")).write_bytes(b"x")  # a rotated part of the oldest
    prune(logs, keep=20)
    assert sorted(p.name for p in logs.iterdir()) == names[-19:]  # room for the next one
    monkeypatch.chdir(tmp_path)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["generate", *TINY, "--max-tokens", "2", "--prompt", "hi"]) == 0
    assert not list(tmp_path.glob("*.memlog"))  # generate records only when asked


def test_the_standby_is_kept_only_when_memory_holds_it(monkeypatch):
    model = PRESETS["tiny"]
    cfg = EngineConfig(device="cpu")
    need = model.num_params * 4 + cfg.cpu_kv_cache_bytes + serve.EXECUTOR_RUNTIME_BYTES
    monkeypatch.setattr(serve, "available_memory_bytes", lambda: serve.STANDBY_ROOM * need)
    on, why = serve.standby_fits(cfg, model)
    assert on and "holds" in why
    monkeypatch.setattr(serve, "available_memory_bytes", lambda: serve.STANDBY_ROOM * need - 1)
    on, why = serve.standby_fits(cfg, model)
    assert not on and "does not hold" in why


def test_disable_tqdm_silences_the_gguf_conversion_bars(capsys):
    from memstep.cli.bench_offline import _gguf_bars_off

    gguf = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    original = gguf.tqdm
    with _gguf_bars_off(True):
        list(gguf.tqdm(range(3), desc="Converting"))
    assert capsys.readouterr().err == "" and gguf.tqdm is original
    with _gguf_bars_off(False):
        list(gguf.tqdm(range(3), desc="Converting"))
    assert "Converting" in capsys.readouterr().err  # the same bar, not silenced: the check fires
