"""A user's mistake (a directory for a file, a file that is not a log, a malformed dataset, an
unknown log level) ends in one line on stderr and exit 2, never a traceback: the real CLI, run in a
subprocess, on real files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = ["--model", "random:tiny", "--num-threads", "1"]


def memstep(*argv: str | Path, timeout: float = 300) -> tuple[int, str, str]:
    res = subprocess.run(
        [sys.executable, "-m", "memstep.cli.main", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return res.returncode, res.stdout, res.stderr


def assert_one_line_error(result: tuple[int, str, str], *words: str) -> None:
    code, out, err = result
    assert "Traceback" not in err, err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("memstep: error: "), err
    for word in words:
        assert word in err, err


@pytest.fixture(scope="module")
def tiny_log(tmp_path_factory) -> Path:
    """A real log: the tiny random model answering one prompt, recorded by `memstep generate`."""
    path = tmp_path_factory.mktemp("log") / "run.memlog"
    code, out, err = memstep(
        "generate", *TINY, "--max-tokens", "4", "--prompt", "hello", "--record", path
    )
    assert code == 0 and path.is_file(), err
    return path


# --- files that are not logs ---------------------------------------------------------------


LOG_COMMANDS = [["replay"], ["inspect"], ["plot", "-o", "x.png"]]


@pytest.mark.parametrize("command", LOG_COMMANDS, ids=lambda c: c[0])
def test_a_directory_as_the_log(tmp_path, command):
    assert_one_line_error(
        memstep(command[0], tmp_path, *command[1:]), f"{tmp_path}: is a directory"
    )


def test_a_missing_log(tmp_path):
    log = tmp_path / "nowhere.memlog"
    assert_one_line_error(memstep("replay", log), f"{log}: no such file")


def test_a_log_below_a_file(tmp_path):
    log = tmp_path / "file.txt" / "run.memlog"
    log.parent.write_text("a file, not a directory\n")
    assert_one_line_error(memstep("inspect", log), "not a directory")


NOT_LOGS = {"empty": b"", "text": b"just some text\n", "binary": bytes(range(256)) * 8}


@pytest.mark.parametrize(
    ("command", "content"), list(zip(LOG_COMMANDS, NOT_LOGS, strict=True)), ids=list(NOT_LOGS)
)
def test_a_file_that_is_not_a_log(tmp_path, command, content):
    log = tmp_path / "not.memlog"
    log.write_bytes(NOT_LOGS[content])
    assert_one_line_error(memstep(command[0], log, *command[1:]), "not a memstep log")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file, whatever its mode")
def test_an_unreadable_log(tiny_log, tmp_path):
    log = tmp_path / "secret.memlog"
    log.write_bytes(tiny_log.read_bytes())
    log.chmod(0)
    assert_one_line_error(memstep("inspect", log), f"{log}: permission denied")


def test_plot_into_a_directory(tiny_log, tmp_path):
    assert_one_line_error(memstep("plot", tiny_log, "-o", tmp_path), "is a directory")
    assert not Path(f"{tmp_path}.png").exists()


def test_plot_where_writing_is_denied(tiny_log):
    # /sys refuses new files even to root
    assert_one_line_error(memstep("plot", tiny_log, "-o", "/sys/mem.png"), "permission denied")


def test_the_good_log_still_works(tiny_log, tmp_path):
    """The fixture is a real log: the errors above come from the paths, not from the log."""
    code, out, err = memstep("plot", tiny_log, "-o", tmp_path / "mem.png")
    assert code == 0 and (tmp_path / "mem.png").stat().st_size > 0, err


# --- flags ---------------------------------------------------------------------------------


def test_an_unknown_log_level(tmp_path):
    assert_one_line_error(memstep("--log-level", "bogus", "inspect", tmp_path), "--log-level")


def test_a_log_level_in_capitals_is_fine(tiny_log):
    code, out, err = memstep("--log-level", "WARNING", "inspect", tiny_log)
    assert code == 0 and "requests: 1 added" in out, err


# --- datasets ------------------------------------------------------------------------------


BAD_DATASETS = {
    "bad-json": (b'{"prompt": "hi", "output_len": 4\n', "ds.jsonl:1: not JSON"),
    "prompt-not-a-string": (b'{"prompt": 5, "output_len": 4}\n', "prompt must be"),
    "output-len-a-string": (b'{"prompt": "hi", "output_len": "4"}\n', "output_len must be"),
    "output-len-negative": (b'{"prompt": "hi", "output_len": -1}\n', "output_len must be"),
    "missing-field": (b'{"prompt": "hi", "output_len": 4}\n{"prompt": "yo"}\n', "ds.jsonl:2"),
    "not-an-object": (b"[1, 2]\n", "ds.jsonl:1: expected"),
    "empty": (b"", "no samples"),
    "binary": (bytes(range(256)) * 4, "not a UTF-8 text file"),
}


@pytest.mark.parametrize("case", list(BAD_DATASETS))
def test_bench_serve_with_a_malformed_dataset(tmp_path, case):
    content, message = BAD_DATASETS[case]
    dataset = tmp_path / "ds.jsonl"
    dataset.write_bytes(content)
    result = memstep("bench", "serve", *TINY, "--dataset", dataset, "--num-prompts", "2")
    assert_one_line_error(result, message)


def test_bench_serve_with_a_directory_as_dataset(tmp_path):
    assert_one_line_error(memstep("bench", "serve", *TINY, "--dataset", tmp_path), "dataset")


@pytest.mark.parametrize("case", ["bad-json", "binary"])
def test_bench_offline_with_a_malformed_dataset(tmp_path, case):
    content, message = BAD_DATASETS[case]
    dataset = tmp_path / "ds.jsonl"
    dataset.write_bytes(content)
    flags = ["--skip-hf", "--num-single", "1", "--num-prompts", "1", "--dataset", dataset]
    result = memstep("--log-level", "error", "bench", "offline", *TINY, *flags)
    assert_one_line_error(result, message)


def test_bench_offline_against_transformers_needs_a_gguf_model():
    result = memstep("bench", "offline", *TINY, "--num-prompts", "0")
    assert_one_line_error(result, "GGUF model", "--skip-hf")
