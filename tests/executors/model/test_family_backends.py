"""What each backend runs for a family whose layers differ from Llama's: the CPU says once at
load that torch runs them; q4 and int8 asked by name quantize a dense family's matrices as
Llama's (the rest of its layers in torch), a mixture of experts' and tensor parallelism are
refused with a clear error; every family preset runs at tiny dimensions."""

from __future__ import annotations

import attrs
import pytest
import structlog
import torch
from tiny_families import (
    FAMILIES,
    make_checkpoint,
    memstep_logits,
    memstep_model,
    prompts,
    write_tokenizer,
)

from memstep.core.config import ConfigError, EngineConfig
from memstep.core.model_config import PRESETS
from memstep.core.model_source import ModelSource, model_config, resolve
from memstep.core.sampling_params import SamplingParams
from memstep.executors.cpu import kernels as cpu_kernels
from memstep.executors.cpu.decode_step import DecodeStep
from memstep.executors.model import kv_cache
from memstep.executors.model.llama import LlamaModel
from memstep.executors.model.weights import load_weights
from memstep.executors.process.assemble import pick_backend
from memstep.executors.process.inprocess import local_engine
from memstep.executors.runtime.worker import family_quantization

CPU = torch.device("cpu")
NEW_PRESETS = ("qwen3-8b", "qwen2.5-7b", "mistral-7b", "gemma-3-12b", "phi-4-mini", "qwen3-30b-a3b")


def lacks_lines(cfg) -> list[str]:
    weights = load_weights(ModelSource("random", None, "tiny"), cfg, torch.float32, CPU)
    with structlog.testing.capture_logs() as logs:
        pick_backend(CPU, cfg, weights, torch.float32)
    return [e["event"] for e in logs if "lacks" in e["event"]]


def test_the_cpu_says_once_which_pieces_torch_runs():
    gemma = attrs.evolve(PRESETS["tiny"], architecture="gemma3", qk_norm=True, norm_offset=1.0)
    assert lacks_lines(gemma) == [
        "backend cpu lacks (1 + w) norm for family gemma3; torch runs its layers "
        "(C decode attention kept for global layers)"
    ]
    assert lacks_lines(PRESETS["tiny"]) == []  # Llama's layers: the C kernels, nothing said
    qwen = attrs.evolve(PRESETS["tiny"], architecture="qwen3", qk_norm=True, qkv_bias=True)
    assert lacks_lines(qwen) == []  # a QKV bias and q/k norms: the C kernels run them too


@pytest.mark.parametrize(
    ("asked", "picked", "ranks", "error"),
    [
        ("int8", "int8", 1, None),  # float matrices quantized, as Llama's
        ("none", "none", 2, "qwen3 runs on one rank: its q/k norm have no tensor-parallel"),
        ("q4", "q4", 1, None),
        ("auto", "q4", 1, None),  # a GGUF of exact types of another family: its blocks kept
    ],
)
def test_what_another_family_may_ask(asked, picked, ranks, error):
    qwen3 = attrs.evolve(PRESETS["tiny"], architecture="qwen3", qk_norm=True)
    cfg = EngineConfig(model="random:tiny", quantization=asked)
    assert family_quantization(cfg, PRESETS["tiny"], picked, 1) == picked  # Llama: as picked
    if error is None:
        assert family_quantization(cfg, qwen3, picked, ranks) == picked
        return
    with pytest.raises(ConfigError, match=error):
        family_quantization(cfg, qwen3, picked, ranks)


@pytest.mark.parametrize("asked", ["q4", "int8"])
def test_a_mixture_of_experts_refuses_q4_and_int8_by_name(asked):
    moe = attrs.evolve(PRESETS["tiny"], architecture="qwen3_moe", num_experts=4)
    cfg = EngineConfig(model="random:tiny", quantization=asked)
    with pytest.raises(ConfigError, match="experts are 3-D tensors"):
        family_quantization(cfg, moe, asked, 1)


DENSE = [family for family in FAMILIES if family not in ("qwen3_moe", "mixtral")]


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")
@pytest.mark.parametrize("model_type", DENSE)
def test_q4_asked_for_a_dense_family_runs_its_matrices_in_blocks(tmp_path, model_type):
    """--quantization q4 on a family's HF checkpoint: every decoder matrix in q4 blocks, the head
    in q8_0, and the logits those of the float model over the very numbers the blocks hold
    (each matrix read back through its kernel), up to float32 rounding; int8 runs too."""
    make_checkpoint(model_type, tmp_path)
    source = resolve(str(tmp_path))
    cfg = model_config(source)
    asked = EngineConfig(model=str(tmp_path), quantization="q4")
    assert family_quantization(asked, cfg, "q4", 1) == "q4"
    weights = load_weights(source, cfg, torch.float32, CPU, quantization="q4")
    assert "lm_head.q8_0" in weights
    held = {k: v for k, v in weights.items() if not k.endswith((".q4_1", ".q8_0"))}
    for name in [k for k in weights if k.endswith(".q4_1")]:
        inputs = weights[name].shape[1] // 24 * 32  # 24 bytes a block of 32 inputs
        held[name.removesuffix(".q4_1")] = cpu_kernels.q4_1_mm(torch.eye(inputs), weights[name]).t()
    assert len(held) == len(weights) - 1  # every q4 matrix read back; the q8_0 head below
    blocks = LlamaModel(cfg, weights, 512, pick_backend(CPU, cfg, weights, torch.float32))
    held["lm_head"] = blocks.head(torch.eye(cfg.hidden_size)).t().contiguous()
    reference = LlamaModel(cfg, held, 512, pick_backend(CPU, cfg, held, torch.float32))
    _, kv = memstep_model(tmp_path)
    reference_kv = [tuple(t.clone() for t in layer) for layer in kv]
    for prompt in prompts():
        ours = memstep_logits(blocks, kv, prompt)
        theirs = memstep_logits(reference, reference_kv, prompt)
        assert (ours - theirs).abs().max().item() < 2e-4, model_type
    int8 = load_weights(source, cfg, torch.float32, CPU, quantization="int8")
    assert "layers.0.wqkv.int8" in int8


@pytest.mark.parametrize("preset", NEW_PRESETS)
def test_each_family_preset_runs_at_tiny_dimensions(preset):
    """The preset's family facts over tiny sizes: random weights of every piece the family
    has, and a forward with finite logits."""
    real = PRESETS[preset]
    rotary = real.rope_dim * 16 // real.head_dim
    scaling = real.rope_scaling
    if scaling and scaling.get("rope_type") == "longrope":  # factors for the tiny rotary
        scaling = scaling | {"short_factor": (1.0,) * (rotary // 2)}
        scaling["long_factor"] = scaling["short_factor"]
    cfg = attrs.evolve(
        real,
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=512,
        head_dim=16,
        layer_windows=real.layer_windows[4:6],
        rope_scaling=scaling,
        rotary_dim=real.rotary_dim and rotary,
        num_experts=min(real.num_experts, 4),
        experts_per_token=min(real.experts_per_token, 2),
        moe_intermediate_size=min(real.moe_intermediate_size, 32),
    )
    assert cfg.unlike_llama == real.unlike_llama
    weights = load_weights(ModelSource("random", None, preset), cfg, torch.float32, CPU)
    model = LlamaModel(cfg, weights, 512, pick_backend(CPU, cfg, weights, torch.float32))
    kv = kv_cache.allocate(2, (64, 4, 2, 16), torch.float32, CPU)
    assert torch.isfinite(memstep_logits(model, kv, list(range(3, 40)))).all()


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")
@pytest.mark.parametrize(("model_type", "piece"), [("qwen2", "biases"), ("qwen3", "qk_norms")])
def test_a_qwen_q4_decode_step_runs_in_one_c_call_with_its_pieces(
    tmp_path, monkeypatch, model_type, piece
):
    """Qwen2's layers are Llama's with a qkv bias, Qwen3's with q and k head norms, which the C
    decode step runs as the kernel-by-kernel path does: a q4 model of either takes the one-call
    step, and its tokens and log-probs are the kernel-by-kernel forward's bit for bit; the step
    planted without its piece parts from them."""
    make_checkpoint(model_type, tmp_path)
    write_tokenizer(tmp_path)
    cfg = EngineConfig(model=str(tmp_path), quantization="q4", max_num_seqs=4)
    engine = local_engine(cfg.replace(enable_prefix_caching=False, matmul_precision="float32"))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)

    def outputs() -> list:
        return [(c.token_ids, c.logprobs) for c in engine.generate(prompts(), params)]

    try:
        one_call = engine.executor.worker.model.backend.one_call
        assert one_call is not None and getattr(one_call, piece) is not None
        calls: list[int] = []
        step = DecodeStep.__call__
        monkeypatch.setattr(DecodeStep, "__call__", lambda *a: calls.append(1) or step(*a))
        in_c = outputs()
        assert len(calls) >= params.max_tokens - 1
        monkeypatch.setattr(DecodeStep, "rows", staticmethod(lambda batch, caches: None))
        assert outputs() == in_c  # kernel by kernel
        monkeypatch.undo()
        setattr(one_call, piece, None)  # planted: the C step without its piece
        assert outputs() != in_c
    finally:
        engine.shutdown()
