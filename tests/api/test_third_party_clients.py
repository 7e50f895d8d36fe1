"""Clients that people already run, unchanged, offline, against a real `memstep serve` (SmolLM2,
float32, unquantized weights): LangChain's ChatOpenAI (chat, stream, a strict tool call),
lm-eval's `local-completions` with `tokenizer_backend=auto` and no tokenizer set up (a local
multiple-choice task and a rolling one; their log-likelihoods against transformers' on the same
weights), and guidellm's default streamed request shape (its token counts against memstep's).
The `openai` SDK's checks are in test_http_openai.py; aiperf cannot be installed beside this venv
(it pins older pyzmq and transformers): its `--per-chunk-usage` request is vLLM's
continuous_usage_stats, tested there."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from memstep.cli.serve import ServerProcess
from memstep.core.model_source import shipped_gguf_path

QUESTION = "What is the capital of France?"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
MC = [
    {
        "question": "The capital of France is",
        "choices": [" Paris", " Rome", " Berlin"],
        "answer": 0,
    },
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
]
ROLLING = {"text": "The quick brown fox jumps over the lazy dog. It was a sunny day in May."}


@pytest.fixture(scope="module")
def server():
    args = ["--model", "smollm2", "--dtype", "float32", "--quantization", "none"]
    with ServerProcess([*args, "--num-threads", "1"], http=True) as proc:
        proc.wait_ready(timeout=300)
        yield proc


def test_langchain_chat_stream_and_a_strict_tool_call(server):
    from langchain_openai import ChatOpenAI

    url = server.http_url + "/v1"
    llm = ChatOpenAI(model="smollm2", base_url=url, api_key="none", temperature=0, max_tokens=16)
    assert "Paris" in llm.invoke(QUESTION).content
    assert "Paris" in "".join(chunk.content for chunk in llm.stream(QUESTION))
    tool = {"type": "function", "function": WEATHER}
    caller = llm.bind_tools([tool], tool_choice="get_weather", strict=True)
    reply = caller.bind(max_tokens=40).invoke("What is the weather in Paris?")
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}


def _task(folder: Path, name: str, kind: str, rows: list[dict], fields: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
    head += f"    test: {data}\ntest_split: test\noutput_type: {kind}\n"
    (folder / f"{name}.yaml").write_text(head + fields)


def _lm_eval_samples(url: str, folder: Path) -> dict[str, list[dict]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    mc = 'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
    mc += 'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
    _task(folder, "memstep_mc", "multiple_choice", MC, mc)
    rolling = 'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
    rolling += "metric_list:\n  - metric: word_perplexity\n"
    _task(folder, "memstep_rolling", "loglikelihood_rolling", [ROLLING], rolling)
    result = lm_eval.simple_evaluate(
        model="local-completions",  # tokenizer_backend: auto, and no tokenizer given
        model_args=f"model=smollm2,base_url={url}/v1/completions,num_concurrent=1,max_retries=1",
        tasks=["memstep_mc", "memstep_rolling"],
        task_manager=TaskManager(include_path=str(folder)),
        log_samples=True,
    )
    assert result is not None
    return result["samples"]


def _hf_logprob(model, context: list[int], continuation: list[int]) -> float:
    """transformers' log-probability of `continuation` after `context`."""
    ids = torch.tensor([context + continuation])
    with torch.inference_mode():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].double()
    rows = torch.log_softmax(logits[len(context) - 1 : -1], dim=-1)
    return float(rows[torch.arange(len(continuation)), torch.tensor(continuation)].sum())


def test_lm_eval_local_completions_matches_transformers(server, tmp_path):
    """lm-eval finds the server's tokenizer itself (/tokenizer_info, /tokenize: before, its
    rolling task sent [null, ...] for want of an end-of-text token) and its log-likelihoods are
    transformers' on the same weights within 1e-4."""
    transformers = pytest.importorskip("transformers")
    samples = _lm_eval_samples(server.http_url, tmp_path)
    path = shipped_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    for sample in samples["memstep_mc"]:
        for (context, continuation), [(served, _)] in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            whole = tok.encode(context + continuation)
            head = tok.encode(context)
            want = _hf_logprob(model, head, whole[len(head) :])
            assert math.isclose(served, want, abs_tol=1e-4), (context, continuation)
    (rolling,) = samples["memstep_rolling"]
    [[served]] = rolling["resps"]
    prefix = tok.bos_token_id  # lm-eval's rolling prefix: the server's bos_token (else eos)
    assert prefix is not None
    want = _hf_logprob(model, [prefix], tok.encode(ROLLING["text"]))
    assert math.isclose(served, want, abs_tol=1e-4)
