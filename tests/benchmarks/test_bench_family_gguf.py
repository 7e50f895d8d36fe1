"""benchmarks/bench_family_gguf.py's Qwen2 copy of the shipped SmolLM2 (the same blocks, q and k
rows in transformers' order, zero QKV biases): picked q4 under auto like the Llama file, its
matrices kept in blocks, it takes the one-call C step as the Llama file does (its zero QKV bias
added there) and gives the Llama file's logits (float32 rounding apart) and greedy tokens. A q
or k row order left as llama.cpp's would move them far."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from memstep.core.config import EngineConfig
from memstep.core.model_source import model_config, resolve, shipped_gguf_path
from memstep.events.plan import SeqPlan
from memstep.executors.model import kv_cache
from memstep.executors.model.llama import LlamaModel
from memstep.executors.model.weights import load_weights
from memstep.executors.process.assemble import pick_backend
from memstep.executors.runtime.batch_builder import build_batch
from memstep.executors.runtime.worker import family_quantization, pick_quantization

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_family_gguf.py"
PROMPT = [1, 504, 3575, 282, 4649, 314, 2, 198, 1812, 30]
CPU = torch.device("cpu")


def auto_model(path: Path) -> LlamaModel:
    source = resolve(str(path))
    cfg, auto = model_config(source), EngineConfig()
    assert family_quantization(auto, cfg, pick_quantization(auto, source, CPU), 1) == "q4"
    weights = load_weights(source, cfg, torch.float32, CPU, quantization="q4")
    assert "layers.0.wqkv.q4_1" in weights and "layers.0.wqkv" not in weights
    return LlamaModel(cfg, weights, 256, pick_backend(CPU, cfg, weights, torch.float32))


def run(model: LlamaModel, new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt's last row of logits, and `new_tokens` greedy tokens after it."""
    cfg = model.cfg
    kv = kv_cache.allocate(
        cfg.num_layers, (16, 16, cfg.num_kv_heads, cfg.head_dim), torch.float32, CPU
    )
    tokens, feed, start, first = list(PROMPT), list(PROMPT), 0, None
    with torch.inference_mode():
        for _ in range(new_tokens):
            seq = SeqPlan("s", start, feed, list(range(16)), True, 0, len(PROMPT))
            batch, _ = build_batch([(seq, feed)], 16, CPU)
            logits = model.logits(model.forward(batch, kv))[-1]
            first = logits if first is None else first
            tokens.append(int(logits.argmax()))
            start, feed = start + len(feed), tokens[-1:]
    assert first is not None
    return first, tokens[len(PROMPT) :]


def test_the_shipped_model_as_a_qwen2_file_runs_its_llama_logits_on_the_blocks(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_family_gguf", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "smollm2-as-qwen2.gguf"
    bench.write_as_qwen2(shipped_gguf_path(), out)
    llama, qwen2 = auto_model(shipped_gguf_path()), auto_model(out)
    assert llama.backend.one_call is not None and qwen2.backend.one_call is not None
    assert qwen2.cfg.qkv_bias and qwen2.layers[0].bqkv is not None
    (ours, our_tokens), (theirs, their_tokens) = run(qwen2, 8), run(llama, 8)
    assert (ours - theirs).abs().max().item() < 1e-3  # logits of about 20
    assert our_tokens == their_tokens
