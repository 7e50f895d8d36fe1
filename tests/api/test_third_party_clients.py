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
import os
import shutil
import subprocess
import sys
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


def test_guidellm_default_streamed_benchmark_has_no_errors_and_memsteps_counts(server, tmp_path):
    """guidellm's default request (chat, streamed, vLLM's continuous_usage_stats, ignore_eos,
    max_completion_tokens) on a synthetic 256-in / 64-out profile at concurrencies 1 and 2:
    no request fails (each failed with 400 on continuous_usage_stats before), and the token
    counts it reports are memstep's: the prompt as /tokenize counts its messages, 64 out."""
    import httpx

    from memstep.cli.main import main as cli_main

    assert cli_main(["export-tokenizer", "--out", str(tmp_path / "tok")]) == 0
    out = tmp_path / "guidellm.json"
    guidellm = shutil.which("guidellm", path=str(Path(sys.executable).parent))
    assert guidellm is not None, "guidellm is in the dev extra"
    backend = f"kind=openai_http,target={server.http_url},model=smollm2"
    cmd = [guidellm, "run", "--backend", backend, "--profile", "kind=concurrent,streams=1"]
    cmd += ["--override", "profile.streams", "1,2", "--constraint", "kind=max_requests,count=2"]
    cmd += ["--tokenizer", f"kind=hf_auto,model={tmp_path / 'tok'}"]
    cmd += ["--data", "kind=synthetic_text,prompt_tokens=256,output_tokens=64"]
    cmd += ["--output", f"kind=json,path={out}", "--disable-console"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    benchmarks = json.loads(out.read_text())["benchmarks"]
    assert [b["config"]["strategy"]["streams"] for b in benchmarks] == [1, 2]
    for bench in benchmarks:
        requests = bench["requests"]
        assert len(requests["successful"]) == 2 and requests["errored"] == []
        for done in requests["successful"]:
            body = json.loads(done["request_args"])["body"]
            assert body["stream_options"]["continuous_usage_stats"] is True
            counted = httpx.post(server.http_url + "/tokenize", json={"messages": body["messages"]})
            assert done["input_metrics"]["text_tokens"] == counted.json()["count"]
            assert done["output_metrics"]["text_tokens"] == 64
