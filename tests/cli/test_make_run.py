"""`make run`, the first thing a newcomer types: the Makefile's own command prints a right answer
on stdout and nothing else on the terminal (its logs, below warning, stay quiet)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_recipe() -> list[str]:
    """The `run` target's memstep command, as this interpreter runs it."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    recipe = lines[lines.index("run: install") + 1].strip()
    program, *args = shlex.split(recipe)
    assert program == "$(BIN)/memstep", recipe
    return [sys.executable, "-m", "memstep.cli.main", *args]


def test_make_run_prints_paris_and_nothing_else():
    run = subprocess.run(run_recipe(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "The capital of France is Paris.\n"
    assert run.stderr == ""  # at --log-level info this held ~11 lines of start-up logs
