"""Load a model's tensors into memstep's layout: fused qkv and gate_up, [out, in] matrices.

Names: `embed`, `norm`, `lm_head` (absent when tied), and per layer `layers.{i}.attn_norm`,
`.wqkv`, `.wo`, `.mlp_norm`, `.w_gate_up`, `.w_down`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import attrs
import numpy as np
import structlog
import torch

from memstep.core.model_config import ModelConfig
from memstep.core.model_source import ModelError, ModelSource, gguf_model_config, read_gguf
from memstep.executors.model import quant_linear as ql
from memstep.executors.model.formats import gguf_blocks, gguf_names
from memstep.executors.model.formats.hf_names import Table, layer_table
from memstep.executors.model.sharding import Shard

Weights = dict[str, torch.Tensor]
log = structlog.get_logger("memstep.executor.weights")

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


# each fused tensor of a layer and the checkpoint tensors it is made of, in row order
_FUSED = {
    "attn_norm": ("attn_norm",),
    "wqkv": ("q", "k", "v"),
    "wo": ("wo",),
    "mlp_norm": ("mlp_norm",),
    "w_gate_up": ("gate", "up"),
    "w_down": ("w_down",),
}


def _fuse_layers(
    raw: dict[str, torch.Tensor],
    cfg: ModelConfig,
    prefix: str,
    names: dict[str, str],
    partial: bool = False,
) -> Weights:
    """Each layer's tensors (`prefix` formatted with the layer index, then `names[key]`), with
    q, k, v and gate, up concatenated into the fused matrices the model multiplies by.
    `partial`: a fused tensor whose parts are not all in `raw` is left out (and they stay)."""
    weights: Weights = {}
    for i in range(cfg.num_layers):
        for fused, keys in _FUSED.items():
            sources = [prefix.format(i=i) + names[key] for key in keys]
            if partial and not all(src in raw for src in sources):
                continue
            parts = [raw.pop(src) for src in sources]
            weights[f"layers.{i}.{fused}"] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return weights


@functools.lru_cache(maxsize=1)
def _load_gguf(path: Path, cfg: ModelConfig) -> Weights:
    """Dequantized float32 tensors, cached: engines of one process share them read-only.
    Llama's q and k rows come back from llama.cpp's rotary order; other families' files keep
    transformers' order and are read through their table (`formats/gguf_names.py`)."""
    tensors = read_gguf(path).tensors
    raw = {t.name: _dequantize(t, path) for t in tensors}
    _log_conversion(tensors, cfg)
    if cfg.architecture == "llama":
        return _assemble_gguf(raw, cfg, path)
    if cfg.architecture in gguf_names.ROTARY_PERMUTED:
        _unpermute_qk(raw, cfg)
    try:
        weights = _fuse_table(raw, cfg, gguf_names.layer_table(cfg), "blk.{i}.")
    except KeyError as exc:
        raise ModelError(f"missing tensor {exc} in {path.name} ({cfg.architecture})") from exc
    what = f"{path.name} (a {cfg.architecture} GGUF)"
    return weights | _assemble(raw, cfg, ("", {}), gguf_names.GLOBAL_NAMES, what, fuse=False)


def _block_forms(tensors: dict, table: Table, num_layers: int) -> dict[str, tuple[str, list[str]]]:
    """Each decoder matrix (`layers.{i}.wqkv`, ...; its parts' names under `blk.{i}.` in the
    family's `table`, Phi-3's qkv and gate_up one part each) whose parts are all in `tensors`
    (a GGUF's, by name) in types that convert exactly into one of the kernels' block forms
    (formats/gguf_blocks.py): the smallest form holding every part, and the parts' names."""
    forms = {}
    for i in range(num_layers):
        for key in ql.LAYER_MATRICES:
            parts = [f"blk.{i}.{name}" for name in table.get(key, ())]
            if not parts or not all(p in tensors for p in parts):
                continue
            form = gguf_blocks.common_form([tensors[p].tensor_type for p in parts])
            if form is not None:
                forms[f"layers.{i}.{key}"] = (form, parts)
    return forms


@functools.lru_cache(maxsize=4)
def gguf_converts_exactly(path: Path) -> bool:
    """Whether every decoder matrix of the GGUF at `path` (any dense family's, through its
    table in `formats/gguf_names.py`) converts exactly into the kernels' blocks: Q2_K, Q3_K,
    Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K or Q8_0 (`gguf_blocks.HELD_BY`). A mixture of
    experts' never does: its experts are [E, rows, columns] tensors, which no block kernel
    multiplies."""
    reader = read_gguf(path)
    table = gguf_names.FAMILY_TABLES.get(gguf_model_config(reader).architecture, {})
    if not all(key in table for key in ql.LAYER_MATRICES):
        return False
    tensors = {t.name: t for t in reader.tensors}
    layers = {int(name.split(".")[1]) for name in tensors if name.startswith("blk.")}
    if not layers or layers != set(range(len(layers))):
        return False
    return len(_block_forms(tensors, table, len(layers))) == len(ql.LAYER_MATRICES) * len(layers)


@functools.lru_cache(maxsize=1)
def _load_gguf_blocks(path: Path, cfg: ModelConfig) -> Weights:
    """The decoder's matrices whose types convert exactly kept in the kernels' block forms
    (`formats/gguf_blocks.py`: each weight gguf's own float32 value, a fused matrix's parts in
    one form, its rows in the family table's order), and the head too where its type converts
    (the tied embedding's or the file's output); every other tensor dequantized to float32 (the
    embedding for its lookup, norms and biases, and matrices of other types, quantized later
    by `quantize_weights`); cached as above. Any dense family: its table
    (`formats/gguf_names.py`) names the parts, as `_load_gguf` reads them."""
    tensors = {t.name: t for t in read_gguf(path).tensors}
    table = gguf_names.layer_table(cfg)
    forms = _block_forms(tensors, table, cfg.num_layers)
    part_form = {part: form for form, names in forms.values() for part in names}
    others = [t for n, t in tensors.items() if n.startswith("blk.") and n not in part_form]
    _log_conversion(others, cfg, then="; the decoder's matrices then to q4 blocks")
    raw = {  # block rows and float32 tensors alike: fusing concatenates either by rows
        name: gguf_blocks.block_rows(t.data, t.tensor_type, part_form[name])
        if name in part_form
        else _dequantize(t, path)
        for name, t in tensors.items()
    }
    if cfg.architecture in gguf_names.ROTARY_PERMUTED:
        _unpermute_qk(raw, cfg)  # a row order: block rows are permuted as float rows are
    try:
        fused = _fuse_table(raw, cfg, table, "blk.{i}.")
    except KeyError as exc:
        raise ModelError(f"missing tensor {exc} in {path.name} ({cfg.architecture})") from exc
    weights = {f"{n}.{forms[n][0]}" if n in forms else n: t for n, t in fused.items()}
    what = f"{path.name} (a {cfg.architecture} GGUF)"
    weights |= _assemble(raw, cfg, ("", {}), gguf_names.GLOBAL_NAMES, what, fuse=False)
    head = tensors.get("token_embd.weight" if cfg.tie_embeddings else "output.weight")
    head_form = None if head is None else gguf_blocks.form_of(head.tensor_type)
    if head is not None and head_form is not None:
        weights.pop("lm_head", None)
        weights[f"lm_head.{head_form}"] = gguf_blocks.block_rows(
            head.data, head.tensor_type, head_form
        )
    return weights


def _log_conversion(tensors, cfg: ModelConfig, then: str = "") -> None:
    """One line for a GGUF whose `tensors` are not all float32: their types, converted to
    float32 at load (no C kernel reads their blocks; the engine's dtype, bfloat16 on CUDA, is
    taken after, or `then` says what follows), and what that costs: their bytes in the file
    and in float32."""
    converted = [t for t in tensors if t.tensor_type.name != "F32"]
    if not converted:
        return
    before = sum(int(t.n_bytes) for t in converted)
    after = sum(4 * int(t.n_elements) for t in converted)
    types = ", ".join(sorted({t.tensor_type.name for t in converted}))
    log.info(
        f"GGUF {types} converted to float32 at load: {_mib(before)} in the file, "
        f"{_mib(after)} as float32 ({after / before:.1f}x){then}",
        family=cfg.architecture,
        tensors=len(converted),
        bytes_before=before,
        bytes_after=after,
    )


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _dequantize(t, path: Path) -> torch.Tensor:
    from gguf import quants

    try:
        array = quants.dequantize(t.data, t.tensor_type)
    except Exception as exc:
        raise ModelError(f"cannot dequantize {t.name} in {path.name}: {exc}") from exc
    return torch.from_numpy(np.array(array, dtype=np.float32))  # owned, writable


def _unpermute_qk(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """q and k rows of a llama.cpp `llama` file back from its interleaved rotary order."""
    for i in range(cfg.num_layers):
        for key, heads in (("attn_q", cfg.num_heads), ("attn_k", cfg.num_kv_heads)):
            name = f"blk.{i}.{key}.weight"
            if name in raw:
                raw[name] = unpermute_rotary(raw[name], heads)


def _assemble_gguf(
    raw: dict[str, torch.Tensor], cfg: ModelConfig, path: Path, partial: bool = False
) -> Weights:
    """memstep's weights from a GGUF's tensors by name: q and k rows back from llama.cpp's
    rotary order, then `_assemble`'s fusing."""
    _unpermute_qk(raw, cfg)
    names = ("token_embd.weight", "output_norm.weight", "output.weight")
    layers = ("blk.{i}.", _GGUF_LAYER)
    return _assemble(raw, cfg, layers, names, f"{path.name} (a Llama GGUF)", partial)


def _load_hf(folder: Path, cfg: ModelConfig) -> Weights:
    """A Hugging Face folder's tensors (one file or the shards its index names; any float
    dtype, widened to float32 here and placed in the engine's dtype later) in memstep's
    layout, through the family's table (`formats/hf_names.py`)."""
    raw = {_text_name(k): v.float() for k, v in _read_safetensors(folder).items()}
    try:
        weights = _fuse_table(raw, cfg, layer_table(cfg))
    except KeyError as exc:
        what = f"{folder} (a {cfg.architecture} checkpoint)"
        raise ModelError(f"missing tensor {exc} in {what}") from exc
    names = ("embed_tokens.weight", "norm.weight", "lm_head.weight")
    weights |= _assemble(raw, cfg, ("", {}), names, f"{folder} (a checkpoint)", fuse=False)
    return with_norm_offset(weights, cfg)


def with_norm_offset(weights: Weights, cfg: ModelConfig) -> Weights:
    """Gemma's (offset + w) norms made plain RMSNorm weights once, at load, in float32 (as
    transformers adds them), so that every backend's RMSNorm runs them unchanged."""
    if not cfg.norm_offset:
        return weights
    return {k: v + cfg.norm_offset if _is_norm(k) else v for k, v in weights.items()}


def _is_norm(name: str) -> bool:
    return name == "norm" or name.endswith("_norm")


_TEXT_PREFIXES = ("language_model.model.", "model.language_model.", "language_model.", "model.")


def _text_name(name: str) -> str:
    """A tensor's name in a text model: without `model.`, or a multimodal checkpoint's text
    model prefix (its vision tower's tensors keep theirs and are left unread)."""
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return name


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / name for name in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder} has no *.safetensors files")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            raw.update(load_file(str(file)))
        except Exception as exc:
            raise ModelError(f"cannot read {file.name}: {exc}") from exc
    return raw


def _fuse_table(
    raw: dict[str, torch.Tensor], cfg: ModelConfig, table: Table, prefix: str = "layers.{i}."
) -> Weights:
    """Each layer's tensors named in `table` (under `prefix`), concatenated in the table's
    order (stacked experts' [E, rows, columns] by rows); an expert's (`{e}` in the name) made
    for each expert and stacked, [E, ...]."""
    weights: Weights = {}
    for i in range(cfg.num_layers):
        p, key_p = prefix.format(i=i), f"layers.{i}."
        for key, names in table.items():
            if any("{e}" in name for name in names):
                per_expert = [
                    torch.cat([raw.pop(p + name.format(e=e)) for name in names])
                    for e in range(cfg.num_experts)
                ]
                weights[key_p + key] = torch.stack(per_expert)
                continue
            parts = [raw.pop(p + name) for name in names]
            rows = 1 if parts[0].dim() == 3 else 0
            weights[key_p + key] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=rows)
    return weights


def _assemble(
    raw: dict[str, torch.Tensor],
    cfg: ModelConfig,
    layers: tuple[str, dict[str, str]],
    names: tuple[str, str, str],
    what: str,
    partial: bool = False,
    fuse: bool = True,
) -> Weights:
    """The engine's weights from a checkpoint's tensors: fused layers (`layers`: the prefix and
    names of `_fuse_layers`), then the embedding, the final norm and (untied) the head, named
    in `names`; a missing tensor is a ModelError, or with `partial` left out."""
    weights = _fuse_layers(raw, cfg, *layers, partial=partial) if fuse else {}
    own = {"embed": names[0], "norm": names[1]}
    if not cfg.tie_embeddings:
        own["lm_head"] = names[2]
    try:
        for key, name in own.items():
            if not partial or name in raw:
                weights[key] = raw.pop(name)
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

    def ones(name: str, size: int = h) -> None:
        weights[name] = torch.ones(size, dtype=dtype, device=device)

    normal("embed", cfg.vocab_size, h)
    ones("norm")
    if not cfg.tie_embeddings:
        normal("lm_head", cfg.vocab_size, h)
    qkv_out = d * (cfg.num_heads + 2 * cfg.num_kv_heads)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        ones(p + "attn_norm")
        normal(p + "wqkv", qkv_out, h)
        if cfg.qkv_bias:
            normal(p + "bqkv", qkv_out)
        if cfg.qk_norm:
            ones(p + "q_norm", d)
            ones(p + "k_norm", d)
        normal(p + "wo", h, cfg.num_heads * d)
        ones(p + "mlp_norm")
        if cfg.sandwich_norms:
            ones(p + "post_attn_norm")
            ones(p + "post_mlp_norm")
        if cfg.is_moe:
            width, experts = cfg.moe_intermediate_size, cfg.num_experts
            normal(p + "router", experts, h)
            normal(p + "experts_gate_up", experts, 2 * width, h)
            normal(p + "experts_down", experts, h, width)
            continue
        normal(p + "w_gate_up", 2 * cfg.intermediate_size, h)
        normal(p + "w_down", h, cfg.intermediate_size)
    return weights


def load_weights(
    source: ModelSource,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    shard: Shard | None = None,
    quantization: str = "none",
) -> Weights:
    """Every tensor of the model on `device`, or this rank's piece of it (`shard`, tensor
    parallelism): floats in `dtype`, and with `quantization` ("int8" or "q4", CPU only, one
    rank) the decoder's matrices and the head in `quant_linear`'s forms; under q4 a GGUF's
    matrices of the types `formats/gguf_blocks.py` reads keep their own codes and values.
    random: weights are made there."""
    shard = shard or Shard(cfg)
    if source.kind == "random":
        weights = _random(cfg, source.weights_seed, dtype, device, shard)
    else:
        assert source.path is not None
        if source.kind == "hf":
            loaded = _load_hf(source.path, cfg)
        elif quantization == "q4":
            loaded = _load_gguf_blocks(source.path, attrs.evolve(cfg, rope_scaling=None))
        else:  # rotary scaling is no weight's business (and a dict is no cache key)
            loaded = _load_gguf(source.path, attrs.evolve(cfg, rope_scaling=None))
        weights = {k: _placed(k, v, device, dtype, shard) for k, v in loaded.items()}
    if quantization == "none":
        return weights
    return ql.quantize_weights(weights, quantization, cfg.num_layers)


def _placed(
    name: str, t: torch.Tensor, device: torch.device, dtype: torch.dtype, shard: Shard
) -> torch.Tensor:
    """A float tensor (this rank's shard of it) in `dtype` on `device`; quantized codes and
    scales as they are (quantization runs on one rank only)."""
    if ql.is_quantized_part(name):
        return t.to(device=device)
    return shard(name, t).to(device=device, dtype=dtype).contiguous()
