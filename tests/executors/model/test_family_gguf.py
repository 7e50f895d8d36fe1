"""GGUF files of each family, written with llama.cpp's names and keys (the `gguf` package for
F32 and Q8_0, memstep's k-quant writer for Q4_K, Q5_K, Q6_K and the Q4_K_M mix): memstep's
logits equal transformers' on the weights the file holds (each matrix quantized and back) within
2e-4 max abs for every type, as the same float32 weights are multiplied. Against the float
checkpoint each type moves the logits by at most its own share (`FLOAT_DISTANCE`, the norm of
the difference over the float logits' norm; these random models amplify an error several
times, real ones far less), and by more than the same-weights tolerance: the file's
quantization is what memstep ran.

The checkpoints are 256 wide (hidden, MLP width, heads of 64): k-quant rows are super-blocks of
256 values. Mistral is written as llama.cpp's converter writes it, a `llama` file without a
window key (as Mistral v0.2 and later have none), and read back as Llama."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import structlog
import torch
from tiny_families import (
    hf_logits,
    make_checkpoint,
    memstep_logits,
    memstep_model,
    one_minus_cosine,
    prompts,
)
from tiny_gguf import GGUF_ARCH, write_gguf

from memstep.core.config import EngineConfig
from memstep.core.model_source import ModelError, gguf_model_config, read_gguf
from memstep.events.plan import SeqPlan
from memstep.executors.cpu import backend as cpu_backend
from memstep.executors.model import kv_cache
from memstep.executors.model import quant_linear as ql
from memstep.executors.runtime.batch_builder import build_batch
from memstep.executors.runtime.worker import pick_quantization

pytest.importorskip("transformers")

# memstep against transformers on the same weights, max abs logit difference (float32; the
# logits reach about 10 in size)
SAME_WEIGHTS = 2e-4
# memstep on the file against transformers on the float checkpoint: relative L2 distance at most
FLOAT_DISTANCE = {
    "F32": 1e-4,
    "Q8_0": 0.2,
    "Q6_K": 0.45,
    "Q5_K": 0.65,
    "Q4_K": 0.95,
    "Q4_K_M": 0.95,
}
# every family in the types llama.cpp users download most; the other two on a dense and a MoE
CASES = [(family, qtype) for family in GGUF_ARCH for qtype in ("F32", "Q8_0", "Q4_K", "Q6_K")]
CASES += [(family, qtype) for family in ("qwen3", "qwen3_moe") for qtype in ("Q5_K", "Q4_K_M")]
WIDE = dict(hidden_size=256, intermediate_size=256, head_dim=64)
_WIDE_FAMILY = {
    "mistral": dict(sliding_window=None),
    "gemma3_text": dict(query_pre_attn_scalar=64),  # llama.cpp scales by the head size
    "qwen3_moe": dict(moe_intermediate_size=256),
    "phi3": dict(  # LongRoPE's factors for a rotary of 48 dims (0.75 of heads of 64)
        rope_scaling=dict(
            rope_type="longrope",
            short_factor=[1.0 + 0.05 * i for i in range(24)],
            long_factor=[3.0 + 0.05 * i for i in range(24)],
            original_max_position_embeddings=128,
        )
    ),
}
_READ_AS = {"mistral": "llama", "gemma3_text": "gemma3"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model_type -> (its folder, transformers' logits of each prompt), made once a module."""
    made: dict = {}

    def checkpoint(model_type: str):
        if model_type not in made:
            folder = tmp_path_factory.mktemp(model_type)
            overrides = WIDE | _WIDE_FAMILY.get(model_type, {})
            model = make_checkpoint(model_type, folder, **overrides)
            made[model_type] = folder, [hf_logits(model, p) for p in prompts()]
        return made[model_type]

    return checkpoint


def held_model(
    folder: Path, held: dict[str, torch.Tensor], out: Path, dtype: torch.dtype = torch.float32
):
    """transformers' float32 model of the checkpoint in `folder` with the matrices `held` (saved
    and loaded, as transformers maps per-expert names onto its fused experts at load), every
    tensor first rounded to `dtype`."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    out.mkdir()
    state = load_file(str(folder / "model.safetensors")) | held
    state = {name: t.to(dtype).float() for name, t in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((folder / "config.json").read_text())
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def max_error(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))


def relative_distance(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    return ((torch.cat(ours) - torch.cat(theirs)).norm() / torch.cat(theirs).norm()).item()


@pytest.mark.parametrize(("model_type", "qtype"), CASES)
def test_gguf_logits_match_the_same_weights_in_transformers(
    tmp_path, checkpoints, model_type, qtype
):
    folder, float_logits = checkpoints(model_type)
    path = tmp_path / f"tiny-{qtype}.gguf"
    held = write_gguf(folder, model_type, path, qtype)
    cfg = gguf_model_config(read_gguf(path))
    assert cfg.architecture == _READ_AS.get(model_type, model_type)
    reference = held_model(folder, held, tmp_path / "held")
    model, kv = memstep_model(path)
    ours = [memstep_logits(model, kv, p) for p in prompts()]
    assert max_error(ours, [hf_logits(reference, p) for p in prompts()]) < SAME_WEIGHTS
    distance = relative_distance(ours, float_logits)
    assert distance < FLOAT_DISTANCE[qtype]
    if qtype != "F32":  # the check sees the quantization: the float model's logits differ
        assert distance > 1e-3


@pytest.mark.parametrize(("qtype", "types"), [("Q4_K_M", "Q4_K, Q6_K"), ("F32", None)])
def test_a_quantized_gguf_says_once_what_it_is_converted_to(tmp_path, checkpoints, qtype, types):
    folder, _ = checkpoints("qwen3")
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf(folder, "qwen3", path, qtype)
    with structlog.testing.capture_logs() as logs:
        memstep_model(path)
    lines = [e for e in logs if "converted to float32 at load" in e["event"]]
    if types is None:  # nothing to convert, nothing said
        assert lines == []
        return
    [line] = lines
    assert line["event"].startswith(f"GGUF {types} converted to float32 at load: ")
    # 256-value super-blocks of 144 (Q4_K) and 210 (Q6_K) bytes against 1024 in float32
    assert 1024 / 210 < line["bytes_after"] / line["bytes_before"] < 1024 / 144
    assert f"({line['bytes_after'] / line['bytes_before']:.1f}x)" in line["event"]


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", GGUF_ARCH)
def test_a_q4_k_m_gguf_runs_on_cuda_in_bfloat16(tmp_path, checkpoints, model_type):
    """On CUDA a GGUF's blocks are dequantized and placed in bfloat16: logits at cosine >= 0.999
    of transformers' float32 forward of the same weights rounded to bfloat16; a mixture of
    experts no further from it than transformers' own bfloat16 forward, twice over (the mean of
    1 - cosine: test_family_gpu.py says why)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from transformers import AutoModelForCausalLM

    folder, _ = checkpoints(model_type)
    path = tmp_path / "tiny-Q4_K_M.gguf"
    held = write_gguf(folder, model_type, path, "Q4_K_M")
    reference = held_model(folder, held, tmp_path / "held", torch.bfloat16).cuda()
    model, kv = memstep_model(path, device="cuda", dtype=torch.bfloat16)
    assert model.w["embed"].dtype == torch.bfloat16 and model.w["embed"].is_cuda
    if model_type in ("qwen3_moe", "mixtral"):
        half = AutoModelForCausalLM.from_pretrained(tmp_path / "held", dtype=torch.bfloat16)
        half = half.cuda().eval()
        ours_off = theirs_off = 0.0
        for prompt in prompts():
            theirs = hf_logits(reference, prompt)
            ours_off += one_minus_cosine(memstep_logits(model, kv, prompt), theirs)
            theirs_off += one_minus_cosine(hf_logits(half, prompt), theirs)
        assert ours_off <= 2 * theirs_off, (model_type, ours_off, theirs_off)
        return
    for prompt in prompts():
        ours, theirs = memstep_logits(model, kv, prompt).float(), hf_logits(reference, prompt)
        cosine = torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0)
        assert cosine.item() >= 0.999, f"{model_type} {len(prompt)} tokens: {cosine.item():.5f}"


def test_an_f16_llama_gguf_under_q4_says_its_matrices_are_quantized_again(tmp_path, checkpoints):
    from memstep.core.model_source import model_config, resolve
    from memstep.executors.model.weights import load_weights

    folder, _ = checkpoints("llama")
    path = tmp_path / "tiny-F16.gguf"  # F16 has no block form: widened, then q4
    write_gguf(folder, "llama", path, "F16")
    source = resolve(str(path))
    with structlog.testing.capture_logs() as logs:
        cfg, cpu = model_config(source), torch.device("cpu")
        weights = load_weights(source, cfg, torch.float32, cpu, quantization="q4")
    [line] = [e["event"] for e in logs if "converted to float32 at load" in e["event"]]
    assert line.startswith("GGUF F16 converted")
    assert line.endswith("; the decoder's matrices then to q4 blocks")
    assert "layers.0.wqkv.q4_1" in weights
    assert pick_quantization(EngineConfig(), source, cpu) == "none"


def greedy(model, kv, prompt: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens after `prompt`: the prompt in one step, then one a step."""
    tokens, feed, start = list(prompt), list(prompt), 0
    with torch.inference_mode():
        for _ in range(new_tokens):
            seq = SeqPlan("s", start, feed, list(range(64)), True, 0, len(prompt))
            batch, _ = build_batch([(seq, feed)], 4, torch.device("cpu"))
            tokens.append(int(model.logits(model.forward(batch, kv))[-1].argmax()))
            start, feed = start + len(feed), tokens[-1:]
    return tokens[len(prompt) :]


# each dense family's CPU_MIX file: the block form of each matrix (tiny_gguf.CPU_MIX's types)
EXACT_FORMS = {
    "layers.0.wqkv": "q8_0",  # Q5_0, Q8_0, Q5_0
    "layers.0.wo": "q5_0",  # Q5_0
    "layers.0.w_gate_up": "q8_0",  # Q5_0, Q8_0
    "layers.0.w_down": "q8_16",  # Q6_K
    "layers.1.wqkv": "q8_16",  # Q4_K, Q4_K, Q6_K
    "layers.1.w_gate_up": "q4_1",  # Q4_K, Q4_K
}
PHI3_FORMS = {  # its qkv and gate_up fused in the file, one type each
    "layers.0.wqkv": "q5_0",  # Q5_0
    "layers.0.w_gate_up": "q8_0",  # Q8_0
    "layers.1.wqkv": "q8_16",  # Q6_K
}
DENSE = [family for family in GGUF_ARCH if family not in ("qwen3_moe", "mixtral")]


def block_model(path: Path):
    """The GGUF at `path` as "auto" loads it on the CPU (asserted: q4, the file's blocks), its
    config and weights, and the model over them."""
    from memstep.core.model_source import model_config, resolve
    from memstep.executors.model.llama import LlamaModel
    from memstep.executors.model.weights import load_weights
    from memstep.executors.process.assemble import pick_backend
    from memstep.executors.runtime.worker import family_quantization

    source, cpu = resolve(str(path)), torch.device("cpu")
    cfg = model_config(source)
    auto = EngineConfig()
    assert family_quantization(auto, cfg, pick_quantization(auto, source, cpu), 1) == "q4"
    with structlog.testing.capture_logs() as logs:
        weights = load_weights(source, cfg, torch.float32, cpu, quantization="q4")
    assert not [e for e in logs if "converted to float32 at load" in e["event"]]
    model = LlamaModel(cfg, weights, 512, pick_backend(cpu, cfg, weights, torch.float32))
    return cfg, weights, model


def against_float32(model, path: Path) -> tuple[float, list, list]:
    """The largest |logit| difference of `model` from the same file's float32 model ("none")
    over the prompts, and each one's greedy tokens for each prompt."""
    reference, reference_kv = memstep_model(path)
    kv = kv_cache.allocate(model.cfg.num_layers, reference_kv[0][0].shape, torch.float32, "cpu")
    ours = [memstep_logits(model, kv, p) for p in prompts()]
    error = max_error(ours, [memstep_logits(reference, reference_kv, p) for p in prompts()])
    tokens = [greedy(model, kv, p, 12) for p in prompts()]
    return error, tokens, [greedy(reference, reference_kv, p, 12) for p in prompts()]


@pytest.mark.parametrize("model_type", DENSE)
def test_a_gguf_of_exact_types_runs_on_the_kernels_blocks_as_its_float32_model(
    tmp_path, checkpoints, model_type
):
    # Q4_K, Q5_0, Q6_K and Q8_0 matrices (tiny_gguf.CPU_MIX) under "auto", for every dense
    # family: each layer's matrices in the form its parts share (none left float32), the whole
    # decode step one C call for Llama's and Qwen2's layers, kernel by kernel for the others'; the
    # logits those of the same file's float32 weights ("none") up to float32 rounding
    # (SAME_WEIGHTS: the sums' order differs; 1.0e-4 seen), the greedy tokens equal
    folder, _ = checkpoints(model_type)
    path = tmp_path / "tiny-mix.gguf"
    write_gguf(folder, model_type, path, "CPU_MIX")
    cfg, weights, model = block_model(path)
    forms = EXACT_FORMS | (PHI3_FORMS if model_type == "phi3" else {})
    forms["lm_head"] = "q8_0" if cfg.tie_embeddings else "q8_16"  # Q8_0 embedding, Q6_K output
    assert {f"{name}.{form}" for name, form in forms.items()} <= set(weights)
    for name in ql.layer_matrices(cfg.num_layers) + ["lm_head"]:
        assert name not in weights  # no float32 matrix: every one in blocks
        assert sum(f"{name}.{form}" in weights for form in ql.BLOCK_FORMS) == 1
    torch_pieces = [p for p in cfg.unlike_llama if p not in cpu_backend.C_PIECES]
    assert (model.backend.one_call is None) == bool(torch_pieces)  # Llama's, Qwen2's: one call
    error, tokens, float32_tokens = against_float32(model, path)
    assert error < SAME_WEIGHTS  # float32 rounding only
    assert tokens == float32_tokens


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1", "Q5_K"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_q4_0_q5_1_or_q5_k_gguf_runs_on_the_blocks_as_its_float32_model(
    tmp_path, checkpoints, model_type, qtype
):
    # the other types that convert exactly (Q4_0's codes - 8 in q8_0, Q5_1's and Q5_K's in
    # q8_16): a file all of one (Q5_K as most of a Q5_K_M file) runs under "auto" on the
    # blocks, with its float32 model's logits and greedy tokens
    folder, _ = checkpoints(model_type)
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf(folder, model_type, path, qtype)
    _, weights, model = block_model(path)
    form = "q8_0" if qtype == "Q4_0" else "q8_16"
    assert f"layers.0.w_down.{form}" in weights and "layers.0.w_down" not in weights
    error, tokens, float32_tokens = against_float32(model, path)
    assert error < SAME_WEIGHTS
    assert tokens == float32_tokens


@pytest.mark.parametrize("plant", ["first part's form", "bias left off"])
def test_a_qwen2_gguf_on_the_blocks_with_a_planted_mistake_leaves_its_float32_logits(
    tmp_path, checkpoints, monkeypatch, plant
):
    # the same-weights check sees a fused matrix whose parts are read in the first part's form
    # (layer 0's qkv: Q8_0's codes packed as Q5_0's), or the QKV bias dropped
    from memstep.executors.model.formats import gguf_blocks

    folder, _ = checkpoints("qwen2")
    path = tmp_path / "tiny-mix.gguf"
    write_gguf(folder, "qwen2", path, "CPU_MIX")
    if plant == "first part's form":
        monkeypatch.setattr(gguf_blocks, "common_form", lambda types: gguf_blocks.form_of(types[0]))
    _, _, model = block_model(path)
    if plant == "bias left off":  # by torch's layers, and by the one-call C step
        model.layers[0] = attrs.evolve(model.layers[0], bqkv=None)
        assert model.backend.one_call is not None
        model.backend.one_call.biases = None
    assert against_float32(model, path)[0] > 100 * SAME_WEIGHTS


def test_a_moe_gguf_under_auto_says_its_experts_keep_float32(tmp_path, checkpoints):
    from memstep.core.model_source import model_config, resolve
    from memstep.executors.runtime.worker import family_quantization

    folder, _ = checkpoints("qwen3_moe")
    path = tmp_path / "tiny-Q8_0.gguf"  # every matrix of an exact type, the experts' too
    write_gguf(folder, "qwen3_moe", path, "Q8_0")
    source, auto = resolve(str(path)), EngineConfig()
    cfg = model_config(source)
    with structlog.testing.capture_logs() as logs:
        picked = pick_quantization(auto, source, torch.device("cpu"))
        assert family_quantization(auto, cfg, picked, 1) == "none"
    [line] = [e["event"] for e in logs if e["event"].startswith("quantization auto: none")]
    assert line.startswith("quantization auto: none for qwen3_moe, whose experts are 3-D")
    model, kv = memstep_model(path)  # and it runs, on float32 weights
    assert torch.isfinite(memstep_logits(model, kv, prompts()[0])).all()


def test_a_phi3_gguf_with_half_its_longrope_factors_is_refused(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "phi3.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    for key in ("block_count", "embedding_length", "feed_forward_length", "context_length"):
        writer.add_uint32(f"phi3.{key}", 64)
    writer.add_uint32("phi3.attention.head_count", 4)
    writer.add_uint32("phi3.vocab_size", 256)
    writer.add_tensor("rope_factors_long.weight", np.ones(6, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="LongRoPE without the tensor 'rope_factors_short"):
        gguf_model_config(read_gguf(path))


def test_a_gguf_of_an_architecture_not_read_is_refused(tmp_path):
    import gguf

    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="unsupported GGUF architecture 'falcon'.*qwen3moe"):
        gguf_model_config(read_gguf(path))
