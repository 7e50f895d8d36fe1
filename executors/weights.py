"""Load a model's tensors into memstep's layout: fused qkv and gate_up, [out, in] matrices.

Names: `embed`, `norm`, `lm_head` (absent when tied), and per layer `layers.{i}.attn_norm`,
`.wqkv`, `.wo`, `.mlp_norm`, `.w_gate_up`, `.w_down`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from memstep.core.model_config import ModelConfig
from memstep.core.model_source import ModelError, ModelSource, read_gguf
from memstep.executors.sharding import Shard

Weights = dict[str, torch.Tensor]

_GGUF_LAYER = {
    "attn_norm": "attn_norm.weight",
    "q": "attn_q.weight",
    "k": "attn_k.weight",
    "v": "attn_v.weight",
    "wo": "attn_output.weight",
    "mlp_norm": "ffn_norm.weight",
    "gate": "ffn_gate.weight",
    "up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


def unpermute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved rotary layout: per head, pairs (2i, 2i+1) back to halves."""
    out, inp = w.shape
    head_dim = out // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def _fuse_layers(
    raw: dict[str, torch.Tensor], cfg: ModelConfig, prefix: str, names: dict[str, str]
) -> Weights:
    """Each layer's tensors (`prefix` formatted with the layer index, then `names[key]`), with
    q, k, v and gate, up concatenated into the fused matrices the model multiplies by."""
    weights: Weights = {}
    for i in range(cfg.num_layers):
        get = lambda key, i=i: raw.pop(prefix.format(i=i) + names[key])  # noqa: E731
        p = f"layers.{i}."
        weights[p + "attn_norm"] = get("attn_norm")
        weights[p + "wqkv"] = torch.cat([get("q"), get("k"), get("v")], dim=0)
        weights[p + "wo"] = get("wo")
        weights[p + "mlp_norm"] = get("mlp_norm")
        weights[p + "w_gate_up"] = torch.cat([get("gate"), get("up")], dim=0)
        weights[p + "w_down"] = get("w_down")
    return weights


@functools.lru_cache(maxsize=1)
def _load_gguf(path: Path, cfg: ModelConfig) -> Weights:
    """Dequantized float32 tensors, cached: engines of one process share them read-only."""
    from gguf import quants

    reader = read_gguf(path)
    raw: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        try:
            array = quants.dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ModelError(f"cannot dequantize {t.name} in {path.name}: {exc}") from exc
        raw[t.name] = torch.from_numpy(np.array(array, dtype=np.float32))  # owned, writable
    for i in range(cfg.num_layers):
        raw[f"blk.{i}.attn_q.weight"] = unpermute_rotary(
            raw[f"blk.{i}.attn_q.weight"], cfg.num_heads
        )
        key = f"blk.{i}.attn_k.weight"
        raw[key] = unpermute_rotary(raw[key], cfg.num_kv_heads)
    names = ("token_embd.weight", "output_norm.weight", "output.weight")
    return _assemble(raw, cfg, ("blk.{i}.", _GGUF_LAYER), names, f"{path.name} (a Llama GGUF)")


def _load_hf(folder: Path, cfg: ModelConfig) -> Weights:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder} has no *.safetensors files")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            raw.update(load_file(str(file)))
        except Exception as exc:
            raise ModelError(f"cannot read {file.name}: {exc}") from exc
    raw = {k.removeprefix("model."): v.float() for k, v in raw.items()}
    names = ("embed_tokens.weight", "norm.weight", "lm_head.weight")
    layers = ("layers.{i}.", HF_LAYER_NAMES)
    return _assemble(raw, cfg, layers, names, f"{folder} (a Llama checkpoint)")


def _assemble(
    raw: dict[str, torch.Tensor],
    cfg: ModelConfig,
    layers: tuple[str, dict[str, str]],
    names: tuple[str, str, str],
    what: str,
) -> Weights:
    """The engine's weights from a checkpoint's tensors: fused layers (`layers`: the prefix and
    names of `_fuse_layers`), then the embedding, the final norm and (untied) the head, named
    in `names`; a missing tensor is a ModelError."""
    embed, norm, head = names
    try:
        weights = _fuse_layers(raw, cfg, *layers)
        weights["embed"] = raw.pop(embed)
        weights["norm"] = raw.pop(norm)
        if not cfg.tie_embeddings:
            weights["lm_head"] = raw.pop(head)
    except KeyError as exc:
        raise ModelError(f"missing tensor {exc} in {what}") from exc
    return weights


def _random(
    cfg: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device, shard: Shard
) -> Weights:
    """Seeded normal weights, each made whole (in the same order at any tensor-parallel size,
    so every rank's piece is a slice of the one model) and cut to `shard` at once."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d = cfg.hidden_size, cfg.head_dim
    weights: Weights = {}

    def normal(name: str, *shape: int, std: float = 0.02) -> None:
        t = torch.empty(*shape, dtype=dtype, device=device)
        weights[name] = shard(name, t.normal_(0.0, std, generator=gen))

    def ones(name: str) -> None:
        weights[name] = torch.ones(h, dtype=dtype, device=device)

    normal("embed", cfg.vocab_size, h)
    ones("norm")
    if not cfg.tie_embeddings:
        normal("lm_head", cfg.vocab_size, h)
    qkv_out = d * (cfg.num_heads + 2 * cfg.num_kv_heads)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        ones(p + "attn_norm")
        normal(p + "wqkv", qkv_out, h)
        normal(p + "wo", h, cfg.num_heads * d)
        ones(p + "mlp_norm")
        normal(p + "w_gate_up", 2 * cfg.intermediate_size, h)
        normal(p + "w_down", h, cfg.intermediate_size)
    return weights


def load_weights(
    source: ModelSource,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    shard: Shard | None = None,
) -> Weights:
    """Every tensor of the model in `dtype` on `device`, or this rank's piece of it (`shard`,
    tensor parallelism); random: weights are made there."""
    shard = shard or Shard(cfg)
    if source.kind == "random":
        return _random(cfg, source.weights_seed, dtype, device, shard)
    assert source.path is not None
    loaded = _load_gguf(source.path, cfg) if source.kind == "gguf" else _load_hf(source.path, cfg)
    return {k: shard(k, v).to(device=device, dtype=dtype).contiguous() for k, v in loaded.items()}
