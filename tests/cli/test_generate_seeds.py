"""`memstep generate --seed`: the engine-wide seed fixes the texts of unseeded requests, and
`--random-weights-seed` names the weights of random: models.  Real SmolLM2, in this process."""

from __future__ import annotations

import contextlib
import io
import json

from memstep.cli.main import main

SAMPLE = ["--temperature", "1.0", "--max-tokens", "16", "--num-threads", "1"]


def generate(*flags: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["generate", "--json", "--prompt", "Write a haiku about the sea.", *flags])
    assert code == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


def test_the_engine_seed_fixes_unseeded_texts():
    first = generate(*SAMPLE, "--seed", "1234")["token_ids"]
    assert generate(*SAMPLE, "--seed", "1234")["token_ids"] == first
    assert generate(*SAMPLE, "--seed", "4321")["token_ids"] != first


def test_random_weights_seed_is_its_own_flag():
    out = io.StringIO()
    flags = ["--model", "random:tiny", "--max-tokens", "2", "--random-weights-seed", "3"]
    with contextlib.redirect_stdout(out):
        assert main(["generate", "--prompt", "hello", *flags, "--seed", "8"]) == 0
    assert "random:tiny (seeded random weights, seed=3)" in out.getvalue()
