"""GGUF files of each family, written with llama.cpp's names and keys by the `gguf` package:
memstep's logits equal transformers' on the weights the file holds (F32, and Q8_0 quantized
and back): 1e-4 max abs for both, as the same float32 weights are multiplied. (Against the
float checkpoint Q8_0 moves these tiny random models' logits by 0.17 to 0.6, and the MoE's by
several units where quantization flips an expert choice.)

Q4_K and Q6_K: the `gguf` package dequantizes them (memstep's loader reads every type through
it) but cannot write them (`gguf.quants.quantize` raises NotImplementedError for the k-quants),
so no file of those types is made here."""

from __future__ import annotations

import pytest
import torch
from tiny_families import hf_logits, make_checkpoint, memstep_logits, memstep_model, prompts
from tiny_gguf import GGUF_ARCH, write_gguf

from memstep.core.model_source import ModelError, gguf_model_config, read_gguf

pytest.importorskip("transformers")

# memstep against transformers on the same weights, max abs logit difference (float32)
SAME_WEIGHTS = {"F32": 1e-4, "Q8_0": 1e-4}


def logits_error(model, kv, reference) -> float:
    return max(
        (hf_logits(reference, p) - memstep_logits(model, kv, p)).abs().max().item()
        for p in prompts()
    )


@pytest.mark.parametrize("qtype", SAME_WEIGHTS)
@pytest.mark.parametrize("model_type", GGUF_ARCH)
def test_gguf_logits_match_the_same_weights_in_transformers(tmp_path, model_type, qtype):
    from transformers import AutoModelForCausalLM

    # llama.cpp's Gemma 3 scales queries by the head size, as the released models' configs do
    gemma = {"query_pre_attn_scalar": 16} if model_type == "gemma3_text" else {}
    float_model = make_checkpoint(model_type, tmp_path / "hf", **gemma)
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf(tmp_path / "hf", model_type, path, qtype, tmp_path / "held")
    cfg = gguf_model_config(read_gguf(path))
    assert cfg.architecture == model_type.removesuffix("_text").replace("qwen3moe", "qwen3_moe")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "held", dtype=torch.float32)
    model, kv = memstep_model(path)
    assert logits_error(model, kv, reference.eval()) < SAME_WEIGHTS[qtype]
    if qtype != "F32":  # the check sees the quantization: the float model's logits differ
        model, kv = memstep_model(path)
        assert logits_error(model, kv, float_model.eval()) > 100 * SAME_WEIGHTS[qtype]


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
