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
            "--greedy",
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


def test_a_curve_key_beginning_with_a_dash_is_read_as_the_flags_value():
    """1 z85 key in 85 begins with "-": after a key flag it is the flag's value, not a flag."""
    import zmq

    from memstep.cli.curve_keys import attach_dashed_keys
    from memstep.cli.main import build_parser

    public = zmq.curve_keypair()[0].decode()
    dashed = "-" + public[1:]
    argv = ["serve", "--curve-client-keys", f"{dashed},{public}", "--curve-secret-key", dashed]
    with pytest.raises(SystemExit):  # what argparse alone makes of it
        build_parser("serve").parse_args(argv)
    args = build_parser("serve").parse_args(attach_dashed_keys(argv))
    assert args.curve_client_keys == f"{dashed},{public}" and args.curve_secret_key == dashed
    # a flag after a key flag stays a flag (argparse then says the value is missing)
    assert attach_dashed_keys(["--curve-client-keys", "--port"]) == [
        "--curve-client-keys",
        "--port",
    ]


def test_the_server_module_entry_reads_a_dashed_curve_key_as_the_flags_value():
    """`python -m memstep.cli.serve` (how ServerProcess starts a server) parses its own
    arguments: a secret key beginning with "-" is still the flag's value. --help after it
    exits 0 once the key is read; argparse alone stops at the key with exit status 2."""
    import zmq

    from memstep.cli import serve

    dashed = "-" + zmq.curve_keypair()[1].decode()[1:]
    with pytest.raises(SystemExit) as done:
        serve.main(["--curve-secret-key", dashed, "--help"])
    assert done.value.code == 0
