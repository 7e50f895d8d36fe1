"""GGUF tensor names as llama.cpp writes them: one table a family, in `hf_names`' form (names
under `blk.{i}.`). llama.cpp stacks each layer's experts in one tensor, [E, rows, columns];
Gemma's norms are stored with their 1 already added."""

from __future__ import annotations

from memstep.core.model_config import ModelConfig
from memstep.executors.model.formats.hf_names import Table, with_pieces

LLAMA: Table = {
    "attn_norm": ("attn_norm.weight",),
    "wqkv": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "wo": ("attn_output.weight",),
    "mlp_norm": ("ffn_norm.weight",),
    "w_gate_up": ("ffn_gate.weight", "ffn_up.weight"),
    "w_down": ("ffn_down.weight",),
}
QKV_BIAS: Table = {"bqkv": ("attn_q.bias", "attn_k.bias", "attn_v.bias")}
QK_NORM: Table = {"q_norm": ("attn_q_norm.weight",), "k_norm": ("attn_k_norm.weight",)}
SANDWICH: Table = {
    "post_attn_norm": ("post_attention_norm.weight",),
    "post_mlp_norm": ("post_ffw_norm.weight",),
}
EXPERTS: Table = {
    "router": ("ffn_gate_inp.weight",),
    "experts_gate_up": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
    "experts_down": ("ffn_down_exps.weight",),
}
PHI3: Table = LLAMA | {"wqkv": ("attn_qkv.weight",), "w_gate_up": ("ffn_up.weight",)}
_DENSE = {key: names for key, names in LLAMA.items() if key not in ("w_gate_up", "w_down")}
FAMILY_TABLES: dict[str, Table] = {
    "llama": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "gemma3": LLAMA | SANDWICH,
    "phi3": PHI3,  # fused qkv, and gate and up in one `ffn_up`, as transformers' Phi-3
    "qwen3_moe": _DENSE | EXPERTS,
    "mixtral": _DENSE | EXPERTS,
}
ROTARY_PERMUTED = ("llama", "mixtral")  # written as llama.cpp's `llama`: q, k rows interleaved
GLOBAL_NAMES = ("token_embd.weight", "output_norm.weight", "output.weight")


def layer_table(cfg: ModelConfig) -> Table:
    """The family's llama.cpp names, its optional pieces (bias, q/k norms) added."""
    return with_pieces(cfg, FAMILY_TABLES, QKV_BIAS, QK_NORM)
