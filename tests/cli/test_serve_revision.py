"""`memstep serve --revision R` of a hub id: the model becomes `ID@R` (resolved at R wherever
it loads; tests/core/test_hub_ids.py) and is served under the plain id; any other model is
refused with the reason."""

from __future__ import annotations

import argparse

import pytest

from memstep.cli.serve import _with_revision
from memstep.core.config import ConfigError


def test_serve_takes_a_revision_for_a_hub_id_only():
    args = argparse.Namespace(model="acme/tiny-qwen3", revision="v2", served_model_name=None)
    _with_revision(args)
    assert (args.model, args.served_model_name) == ("acme/tiny-qwen3@v2", "acme/tiny-qwen3")
    _with_revision(args)  # again, as a replica's command line holds both: the same
    assert args.model == "acme/tiny-qwen3@v2"
    with pytest.raises(ConfigError, match="--revision goes with a hub id"):
        _with_revision(argparse.Namespace(model="smollm2", revision="v2", served_model_name=None))
