"""`--tokenizer`: a random: model driven by SmolLM2's real BPE tokenizer, from its GGUF or from
the tokenizer.json that `memstep export-tokenizer` writes."""

from __future__ import annotations

import json

import pytest

from memstep.cli.main import main as cli_main
from memstep.core.config import EngineConfig
from memstep.core.model_source import ModelError, model_config, resolve, shipped_gguf_path
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import EngineStarted
from memstep.executors.process.inprocess import local_engine

TEXT = "The quick brown fox jumps over the lazy dog, twice."


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    assert cli_main(["export-tokenizer", "--out", str(out)]) == 0
    return str(out)


def test_exported_tokenizer_encodes_as_the_gguf_does(tokenizer_json):
    gguf = resolve("smollm2")
    exported = resolve("random:tiny", tokenizer=tokenizer_json)
    from memstep.core.tokenizer import load_tokenizer

    ids = load_tokenizer(gguf, 49152, (2,)).encode(TEXT)
    assert load_tokenizer(exported, 49152, (2,)).encode(TEXT) == ids
    assert len(ids) < len(TEXT.encode()) / 2  # BPE, not the byte tokenizer


@pytest.mark.parametrize("which", ["json", "gguf"])
def test_random_model_with_a_real_tokenizer_serves_and_records_it(tokenizer_json, which):
    path = tokenizer_json if which == "json" else str(shipped_gguf_path())
    records: list[object] = []
    cfg = EngineConfig(model="random:tiny", tokenizer=path, num_threads=1)
    engine = local_engine(cfg, [records.append])
    assert engine.model_cfg.vocab_size == 49152  # widened from the preset's 512
    out = engine.generate([TEXT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.prompt_tokens == len(engine.tokenizer.encode(TEXT)) < 20
    started = next(r for r in records if isinstance(r, EngineStarted))
    assert started.config["tokenizer"] == path and "tokenizer=" in started.model_identity


def test_a_tokenizer_larger_than_a_real_models_vocab_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(50_000)} | {"[UNK]": 50_000}
    big = tmp_path / "big.json"
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(big))
    with pytest.raises(ModelError, match="50001 ids; the model's vocabulary has 49152"):
        model_config(resolve("smollm2", tokenizer=str(big)))
    assert model_config(resolve("random:tiny", tokenizer=str(big))).vocab_size == 50_001


@pytest.mark.parametrize("bad", ["missing.json", "tokenizer.txt"])
def test_a_bad_tokenizer_path_is_a_clear_error(tmp_path, bad):
    (tmp_path / "tokenizer.txt").write_text("not a tokenizer")
    with pytest.raises(ModelError, match="tokenizer not found"):
        resolve("random:tiny", tokenizer=str(tmp_path / bad))
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(ModelError, match="cannot read tokenizer"):
        model_config(resolve("random:tiny", tokenizer=str(broken)))


def test_the_exported_folder_is_the_tokenizer_whole_for_transformers(tmp_path):
    """transformers loads the folder with its special tokens and chat template: the same ids,
    the same chat text as memstep's, and the bos/eos/pad of SmolLM2's card (before, a bare
    tokenizer.json loaded without them, and lm-eval's rolling task sent [null, ...])."""
    transformers = pytest.importorskip("transformers")
    from memstep.core.tokenizer import load_tokenizer

    assert cli_main(["export-tokenizer", "--out", str(tmp_path / "tok")]) == 0
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    ours = load_tokenizer(resolve("smollm2"), 49152, (2,))
    assert hf.encode(TEXT, add_special_tokens=False) == ours.encode(TEXT)
    chat = [{"role": "user", "content": TEXT}]
    text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == ours.apply_chat_template(chat)
    assert hf.eos_token_id == ours.encode("<|im_end|>")[0]


def _gguf_tokenizer_file(path, add_bos: bool):
    """SmolLM2's tokenizer fields in a GGUF of their own, `tokenizer.ggml.add_bos_token` set as
    asked (a Llama 3 or Gemma GGUF sets it; SmolLM2's does not)."""
    from gguf import GGUFReader, GGUFWriter

    from memstep.core.model_source import gguf_field

    reader = GGUFReader(shipped_gguf_path())
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(list(gguf_field(reader, "tokenizer.ggml.tokens")))
    writer.add_token_merges(list(gguf_field(reader, "tokenizer.ggml.merges")))
    writer.add_token_types(list(gguf_field(reader, "tokenizer.ggml.token_type")))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(gguf_field(reader, "tokenizer.chat_template"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("add_bos", [True, False])
def test_a_gguf_that_adds_a_bos_has_it_on_generated_texts_and_not_on_chats(tmp_path, add_bos):
    """llama.cpp adds the BOS where the file says `add_bos_token`: memstep's `LLM.generate` of a
    text does (vLLM's add_special_tokens=True), a chat gets only its template's, token ids are
    taken as given; without the flag, no BOS (SmolLM2 as shipped)."""
    from memstep import LLM

    path = _gguf_tokenizer_file(tmp_path / "tok.gguf", add_bos)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    with LLM("random:tiny", tokenizer=str(path), num_threads=1) as llm:
        tok = llm.engine.tokenizer
        (text,) = llm.generate(TEXT, params, use_tqdm=False)
        assert text.prompt_token_ids == [1] * add_bos + tok.encode(TEXT)
        (ids,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert ids.prompt_token_ids == [5, 6, 7]
        chat = [{"role": "user", "content": "Hi"}]
        (answer,) = llm.chat(chat, params, use_tqdm=False)
        assert answer.prompt_token_ids == tok.encode_chat(chat)
