"""A tiny transformers checkpoint written as a GGUF file with llama.cpp's names and keys, in one
quant type (or llama.cpp's Q4_K_M mix), and the weights that file holds (for the reference
logits)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from memstep.executors.model.formats import kquant_writer

GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",  # llama.cpp's converter writes Mistral as llama (no window key)
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",  # llama.cpp writes Mixtral as llama with experts
}
_LAYER = {  # transformers' name under model.layers.{i}. -> llama.cpp's under blk.{i}.
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # Phi-3's fused matrices
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
}
_GEMMA = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_EXPERT = re.compile(
    r"(?:mlp\.experts\.(\d+)\.(gate|up|down)_proj|block_sparse_moe\.experts\.(\d+)\.(w1|w3|w2))"
    r"\.weight"
)
_MIXTRAL = {"w1": "gate", "w3": "up", "w2": "down"}


def llama_cpp_names(state: dict[str, torch.Tensor], model_type: str, tied: bool) -> dict:
    """transformers' saved tensor name -> llama.cpp's (experts: their stacked tensor's name and
    index)."""
    layer = _LAYER | (_GEMMA if model_type == "gemma3_text" else {})
    names: dict[str, str | tuple[str, int]] = {}
    for name in state:
        if name in _GLOBAL:
            if not (name == "lm_head.weight" and tied):
                names[name] = _GLOBAL[name]
            continue
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        if match := _EXPERT.fullmatch(rest):
            expert, kind = match[1] or match[3], match[2] or _MIXTRAL[match[4]]
            names[name] = (f"blk.{i}.ffn_{kind}_exps.weight", int(expert))
        else:
            names[name] = f"blk.{i}.{layer[rest]}"
    return names


# "CPU_MIX": every type the CPU kernels read exactly (formats/gguf_blocks.py), by layer parity,
# so that fused matrices have parts of one type, of two types of one form, and of two forms
# (Phi-3's qkv and gate_up come fused: one type each)
CPU_MIX = {
    "attn_qkv": ("Q5_0", "Q6_K"),
    "attn_q": ("Q5_0", "Q4_K"),
    "attn_k": ("Q8_0", "Q4_K"),
    "attn_v": ("Q5_0", "Q6_K"),
    "attn_output": ("Q5_0", "Q6_K"),
    "ffn_gate": ("Q5_0", "Q4_K"),
    "ffn_up": ("Q8_0", "Q4_K"),
    "ffn_down": ("Q6_K", "Q4_K"),
}
CPU_MIX_GLOBAL = {"token_embd.weight": "Q8_0", "output.weight": "Q6_K"}


def matrix_type(name: str, qtype: str, num_layers: int, tied: bool) -> str:
    """The type the matrix llama.cpp names `name` is written in: `qtype`, or under "Q4_K_M"
    what llama.cpp's mix gives it, under "CPU_MIX" what CPU_MIX says; a router stays F32
    (llama.cpp never quantizes `ffn_gate_inp`)."""
    if name.endswith("ffn_gate_inp.weight"):
        return "F32"
    if qtype == "Q4_K_M":
        return kquant_writer.q4_k_m_type(name, num_layers, has_output=not tied)
    if qtype == "CPU_MIX":
        parts = name.split(".")
        if parts[0] != "blk" or parts[2] not in CPU_MIX:  # norms F32
            return CPU_MIX_GLOBAL.get(name, "F32")
        return CPU_MIX[parts[2]][int(parts[1]) % 2]
    return qtype


def _blocks(array: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """`array` in `qtype`'s blocks (the k-quants by memstep's writer, the rest by the `gguf`
    package) and the float32 values they hold."""
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType[qtype]
    if qtype in kquant_writer.BLOCK_BYTES:
        blocks = kquant_writer.quantize(array, qtype)
    else:
        blocks = quants.quantize(array, kind)
    return blocks, quants.dequantize(blocks, kind).reshape(array.shape)


def write_gguf(folder: Path, model_type: str, path: Path, qtype: str) -> dict[str, torch.Tensor]:
    """The checkpoint in `folder` as a GGUF at `path` with llama.cpp's names and keys, its
    matrices in `qtype` (norms and biases F32, as llama.cpp keeps them; Gemma's norms with
    their 1 added, as its converter writes them); returns the checkpoint's matrices with the
    values the GGUF holds (each quantized and back), by transformers' names."""
    import gguf
    from gguf import GGMLQuantizationType
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    state = load_file(str(folder / "model.safetensors"))
    names = llama_cpp_names(state, model_type, cfg.tie_word_embeddings)
    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, cpp in names.items():
        array = state[name].float().numpy()
        if model_type == "gemma3_text" and name.endswith("norm.weight"):
            array = array + 1
        if GGUF_ARCH[model_type] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            array = _permute(array, heads)
        if isinstance(cpp, tuple):
            experts.setdefault(cpp[0], {})[cpp[1]] = array
        else:
            tensors[cpp] = array
    tensors |= {key: np.stack([per[e] for e in sorted(per)]) for key, per in experts.items()}
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[model_type])
    _write_keys(writer, GGUF_ARCH[model_type], cfg, model_type)
    held: dict[str, np.ndarray] = {}
    for cpp, array in tensors.items():
        kind = matrix_type(cpp, qtype, cfg.num_hidden_layers, cfg.tie_word_embeddings)
        if array.ndim == 1 or kind == "F32":
            writer.add_tensor(cpp, array)
            held[cpp] = array
            continue
        blocks, held[cpp] = _blocks(array, kind)
        writer.add_tensor(cpp, blocks, raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    matrices = {}
    for name, cpp in names.items():
        if state[name].dim() == 1:
            continue
        array = held[cpp[0]][cpp[1]] if isinstance(cpp, tuple) else held[cpp]
        if GGUF_ARCH[model_type] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            array = _permute(array, heads, back=True)  # rows quantize alone: order commutes
        matrices[name] = torch.from_numpy(np.array(array, dtype=np.float32))
    return matrices


def _permute(w: np.ndarray, heads: int, back: bool = False) -> np.ndarray:
    """llama.cpp's rotary order of q or k rows in a `llama` file (its converter's permute), or
    with `back` transformers' order again."""
    half = w.shape[0] // heads // 2
    split = (heads, half, 2) if back else (heads, 2, half)
    return w.reshape(*split, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_keys(writer, arch: str, cfg, model_type: str) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if model_type == "phi3":
        _write_phi3(writer, cfg)
        head_dim = 0  # llama.cpp's Phi-3 files name no key length: the head is hidden / heads
    for key, value in {
        "block_count": cfg.num_hidden_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "vocab_size": cfg.vocab_size,
    }.items():
        if value:
            writer.add_uint32(f"{arch}.{key}", value)
    rope = cfg.rope_parameters
    writer.add_float32(f"{arch}.rope.freq_base", (rope.get("full_attention") or rope)["rope_theta"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    if model_type == "gemma3_text":
        writer.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
        windowed = [t == "sliding_attention" for t in cfg.layer_types]
        writer.add_sliding_window_pattern(windowed)
    if model_type in ("qwen3_moe", "mixtral"):
        experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
        writer.add_uint32(f"{arch}.expert_count", experts)
        writer.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
    if model_type == "qwen3_moe":
        writer.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)


def _write_phi3(writer, cfg) -> None:
    """What llama.cpp's converter adds for Phi-3 (`conversion/phi.py`): the rotary's dims, the
    window (0 for none), and LongRoPE's factors as tensors with its original context and
    attention factor as keys."""
    import math

    rope = cfg.rope_parameters
    dims = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
    writer.add_rope_dimension_count(dims)
    writer.add_sliding_window(cfg.sliding_window or 0)
    if rope.get("rope_type") != "longrope":
        return
    original = rope["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    scale = cfg.max_position_embeddings / original
    writer.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    )
    for kind in ("long", "short"):
        factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
        writer.add_tensor(f"rope_factors_{kind}.weight", factors)
