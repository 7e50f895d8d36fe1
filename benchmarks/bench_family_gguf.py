"""A dense family's GGUF on the CPU under `--quantization auto`: the shipped SmolLM2 (a Llama
Q4_1 file) written again as a Qwen2 file, and both decoded greedily, one stream.

The Qwen2 file holds the same blocks (Q4_1 matrices, the Q8_0 embedding: copied, not
quantized again), its q and k rows back from llama.cpp's rotary order (Qwen2's files keep
transformers'), zero QKV biases and the keys under `qwen2.`: the same model, so its greedy
tokens must be the Llama file's, and what differs is the path. Under auto both run their
decode step as one C call (Qwen2's adds its QKV bias there), their matrices in the C block
kernels; a family whose other pieces the C step lacks (q/k norms, ...) runs kernel by kernel in
torch over the same block kernels. Prints each file's decode tok/s (the
median of `bench_llamacpp_greedy.py`'s four prompts, a warm-up first) and whether the tokens
agree.

    python benchmarks/bench_family_gguf.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --out qwen2.gguf [--tokens 32] [--threads 2] [--quantization auto]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np


def write_as_qwen2(src: Path, dst: Path) -> None:
    """The Llama GGUF at `src` as a Qwen2 file at `dst` (see the module's docstring)."""
    import gguf

    reader = gguf.GGUFReader(src)
    assert reader.fields["general.architecture"].contents() == "llama", src
    writer = gguf.GGUFWriter(str(dst), "qwen2")
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        name = (
            field.name.replace("llama.", "qwen2.", 1)
            if field.name.startswith("llama.")
            else field.name
        )
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    heads, kv_heads = (
        int(reader.fields[f"llama.attention.{key}"].contents())
        for key in ("head_count", "head_count_kv")
    )
    for t in reader.tensors:
        data = np.array(t.data)
        for key, count in (("attn_q", heads), ("attn_k", kv_heads)):
            if t.name.endswith(f".{key}.weight"):
                data = _unpermute(data, count)
                bias = t.name.replace(".weight", ".bias")
                writer.add_tensor(bias, np.zeros(data.shape[0], dtype=np.float32))
        if t.name.endswith(".attn_v.weight"):
            bias = t.name.replace(".weight", ".bias")
            writer.add_tensor(bias, np.zeros(data.shape[0], dtype=np.float32))
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, data)
        else:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows (floats or a row's blocks) from llama.cpp's rotary order: per head, pairs
    (2i, 2i + 1) back to halves, as `weights.unpermute_rotary`."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def quantization(path: Path, asked: str) -> str:
    """What the engine's worker picks for the GGUF at `path` on the CPU (its log says it too)."""
    import torch

    from memstep.core.config import EngineConfig
    from memstep.core.model_source import model_config, resolve
    from memstep.executors.runtime.worker import family_quantization, pick_quantization

    cfg, source = EngineConfig(model=str(path), quantization=asked), resolve(str(path))
    picked = pick_quantization(cfg, source, torch.device("cpu"))
    return family_quantization(cfg, model_config(source), picked, 1)


def main(argv: list[str] | None = None) -> int:
    from bench_llamacpp_greedy import memstep_greedy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, type=Path, help="a Llama GGUF (the shipped one)")
    p.add_argument("--out", required=True, type=Path, help="where its Qwen2 file is written")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantization", default="auto")
    args = p.parse_args(argv)
    if not args.out.is_file():
        write_as_qwen2(args.model, args.out)
    paths = (args.model, args.out)
    runs = {path.name: memstep_greedy(path, args) for path in paths}
    tokens = [[prefixes[-1] for prefixes, _ in run] for run in runs.values()]
    for path, run in zip(paths, runs.values(), strict=True):
        speeds = [round(speed, 1) for _, speed in run]
        print(
            f"{path.name}: quantization {quantization(path, args.quantization)}, decode median "
            f"{statistics.median(speeds):.1f} tok/s ({speeds})"
        )
    print(f"greedy texts equal: {tokens[0] == tokens[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
