"""A hub id (`owner/name`, at a revision: `owner/name@rev`) resolves through the Hugging Face
cache, offline, to its snapshot folder; one not cached is one clear error."""

from __future__ import annotations

import json

import pytest

from memstep.core.model_source import ModelError, model_config, resolve

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """A cache as huggingface_hub lays it out, holding acme/tiny-qwen3 at one commit."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-qwen3"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(QWEN3))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def test_a_cached_hub_id_resolves_offline_to_its_snapshot(offline_cache):
    source = resolve("acme/tiny-qwen3")
    assert source.kind == "hf" and source.path == offline_cache
    assert model_config(source).architecture == "qwen3"


def test_an_uncached_hub_id_offline_is_one_clear_error(offline_cache):
    with pytest.raises(ModelError, match="acme/other: not in the local cache"):
        resolve("acme/other")


def test_an_unknown_architecture_names_the_ones_memstep_runs(offline_cache):
    config = offline_cache / "config.json"
    config.write_text(
        json.dumps(QWEN3 | {"architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    )
    with pytest.raises(ModelError, match="FalconForCausalLM.*Qwen3ForCausalLM"):
        model_config(resolve("acme/tiny-qwen3"))


def test_a_revision_picks_its_snapshot_from_a_cache_holding_two(offline_cache):
    """`--revision` (serve turns it into `ID@REV`) by commit or by a ref the cache holds;
    without one, main's; one the cache lacks is the clear error."""
    repo = offline_cache.parent.parent
    other = "fedcba9876543210fedcba9876543210fedcba98"
    (repo / "snapshots" / other).mkdir()
    (repo / "snapshots" / other / "config.json").write_text(json.dumps(QWEN3 | {"head_dim": 32}))
    (repo / "refs" / "v2").write_text(other)
    for spec in (f"acme/tiny-qwen3@{other}", "acme/tiny-qwen3@v2"):
        source = resolve(spec)
        assert source.path == repo / "snapshots" / other and model_config(source).head_dim == 32
    assert resolve("acme/tiny-qwen3").path == offline_cache
    with pytest.raises(ModelError, match="acme/tiny-qwen3: not in the local cache"):
        resolve("acme/tiny-qwen3@v3")
