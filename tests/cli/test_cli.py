"""`memstep generate` end to end, in a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("flags", [[], ["--kv-cache-dtype", "fp8"]], ids=["default", "fp8-kv"])
def test_generate_json_answers_the_question(flags):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "memstep.cli.main",
            "generate",
            "--json",
            "--max-tokens",
            "12",
            "--prompt",
            "What is the capital of France?",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert "Paris" in out["text"]
    assert all(isinstance(t, int) for t in out["token_ids"]) and out["token_ids"]


def test_random_model_is_labelled_random():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "memstep.cli.main",
            "generate",
            "--model",
            "random:tiny",
            "--max-tokens",
            "4",
            "--prompt",
            "hello",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "random:tiny (seeded random weights" in res.stdout
