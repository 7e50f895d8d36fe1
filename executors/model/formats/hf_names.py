"""Hugging Face safetensors names: one table a family, each memstep layer tensor and the
checkpoint tensors it is made of, in row order (several are concatenated: q, k, v into `wqkv`).

A name with `{e}` is an expert's: the tensor is made for each expert and stacked, [E, ...].
Names are under `model.layers.{i}.` (the prefix is dropped before the table is read).
"""

from __future__ import annotations

from memstep.core.model_config import ModelConfig

Table = dict[str, tuple[str, ...]]

_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
LLAMA: Table = {
    "attn_norm": ("input_layernorm.weight",),
    "wqkv": _QKV,
    "wo": ("self_attn.o_proj.weight",),
    "mlp_norm": ("post_attention_layernorm.weight",),
    "w_gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "w_down": ("mlp.down_proj.weight",),
}
QKV_BIAS: Table = {"bqkv": tuple(name.replace(".weight", ".bias") for name in _QKV)}
QK_NORM: Table = {"q_norm": ("self_attn.q_norm.weight",), "k_norm": ("self_attn.k_norm.weight",)}
SANDWICH: Table = {
    "post_attn_norm": ("post_attention_layernorm.weight",),
    "mlp_norm": ("pre_feedforward_layernorm.weight",),
    "post_mlp_norm": ("post_feedforward_layernorm.weight",),
}
FUSED: Table = {"wqkv": ("self_attn.qkv_proj.weight",), "w_gate_up": ("mlp.gate_up_proj.weight",)}


def experts(router: str, expert: str, gate: str, up: str, down: str) -> Table:
    """A mixture-of-experts block in place of the MLP: the router and each expert's matrices."""
    return {
        "router": (router,),
        "experts_gate_up": (expert + gate, expert + up),
        "experts_down": (expert + down,),
    }


_DENSE = {key: names for key, names in LLAMA.items() if key not in ("w_gate_up", "w_down")}
FAMILY_TABLES: dict[str, Table] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "gemma3": LLAMA | SANDWICH,
    "phi3": LLAMA | FUSED,
    "qwen3_moe": _DENSE
    | experts(
        "mlp.gate.weight",
        "mlp.experts.{e}.",
        "gate_proj.weight",
        "up_proj.weight",
        "down_proj.weight",
    ),
    "mixtral": _DENSE
    | experts(
        "block_sparse_moe.gate.weight",
        "block_sparse_moe.experts.{e}.",
        "w1.weight",
        "w3.weight",
        "w2.weight",
    ),
}


def layer_table(cfg: ModelConfig) -> Table:
    """The family's checkpoint names, its optional pieces (bias, q/k norms) added."""
    return with_pieces(cfg, FAMILY_TABLES, QKV_BIAS, QK_NORM)


def with_pieces(cfg: ModelConfig, tables: dict[str, Table], bias: Table, norms: Table) -> Table:
    """The family's table of `tables`, with the config's optional pieces (`bias` for a QKV
    bias, `norms` for q/k norms) added: one rule for every format's names."""
    table = dict(tables[cfg.architecture])
    if cfg.qkv_bias:
        table |= bias
    if cfg.qk_norm:
        table |= norms
    return table
