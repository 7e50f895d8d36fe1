"""Clients that people already run, unchanged, offline, against a real `memstep serve` (SmolLM2,
float32, unquantized weights): LangChain's ChatOpenAI (chat, stream, a strict tool call),
lm-eval's `local-completions` with `tokenizer_backend=auto` and no tokenizer set up (a local
multiple-choice task and a rolling one; their log-likelihoods against transformers' on the same
weights), guidellm's default streamed request shape and aiperf's `--per-chunk-usage` profile
(their token counts against memstep's). aiperf pins older pyzmq and transformers than this venv's,
so it runs from a venv of its own that `make test` builds (`make install-aiperf`). The `openai`
SDK's checks are in test_http_openai.py."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memstep.cli.serve import ServerProcess
from memstep.core.model_source import shipped_gguf_path
from memstep.events.log import read_log
from memstep.events.types import RequestFinished
from memstep.replay.request_view import find_engine_id

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
AIPERF = Path(__file__).parents[3] / ".venv-aiperf" / "bin" / "aiperf"
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


def _aiperf_records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "profile_export_raw.jsonl").open()]


def _chunk_usages(record: dict) -> list[dict]:
    """The usage on each streamed chunk of one of aiperf's raw records, in order."""
    bodies = [p["value"] for r in record["responses"] for p in r["packets"] if p["name"] == "data"]
    return [json.loads(body)["usage"] for body in bodies if body != "[DONE]"]


def _finished(log: Path, request_ids: list[str]) -> dict[str, RequestFinished]:
    """Each request's RequestFinished in the server's event log, by the X-Request-ID aiperf sent
    (flushed once a step: the last one may land just after its stream closed)."""
    for _ in range(50):
        _, records, _ = read_log(log)
        done = {r.request_id: r for r in records if isinstance(r, RequestFinished)}
        found = {rid: done.get(find_engine_id(records, rid)) for rid in request_ids}
        if all(found.values()):
            return {rid: rec for rid, rec in found.items() if rec is not None}
        time.sleep(0.1)
    raise AssertionError(f"requests not finished in {log}: {request_ids}")


def test_aiperf_per_chunk_usage_profile_has_no_errors_and_memsteps_counts(server, tmp_path):
    """aiperf's streamed chat profile with `--per-chunk-usage` (vLLM's continuous_usage_stats,
    which memstep refused with a 400 before) on a synthetic 256-in / 64-out profile at
    concurrencies 1 and 2: no request fails, every chunk carries the usage so far, and the prompt
    and output token counts aiperf exports per request are those memstep's event log holds.
    aiperf runs offline: its tokenizer is the folder `export-tokenizer` writes, and the hub's
    address is a closed local port, so a hub lookup would fail at once."""
    from memstep.cli.main import main as cli_main

    assert AIPERF.exists(), f"no {AIPERF}: `make install-aiperf` makes it"
    assert cli_main(["export-tokenizer", "--out", str(tmp_path / "tok")]) == 0
    out = tmp_path / "aiperf"
    cmd = [str(AIPERF), "profile", "--model", "smollm2", "--url", server.http_url]
    cmd += ["--endpoint-type", "chat", "--streaming", "--use-server-token-count"]
    cmd += ["--per-chunk-usage", "--tokenizer", str(tmp_path / "tok"), "--isl", "256"]
    cmd += ["--osl", "64", "--concurrency", "1,2", "--request-count", "2", "--random-seed", "0"]
    cmd += ["--ui", "none", "--no-server-metrics", "--no-gpu-telemetry", "--export-level", "raw"]
    cmd += ["--artifact-dir", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # aiperf's venv, not ours
    # HF_HUB_OFFLINE is left unset: aiperf 0.13 then looks a local tokenizer folder up in the
    # hub's cache, and fails
    env |= {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_TELEMETRY": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
    for concurrency in (1, 2):
        summary = json.loads(
            (out / f"concurrency_{concurrency}/profile_export_aiperf.json").read_text()
        )
        assert summary["error_summary"] == [] and summary["request_error_rate"]["avg"] == 0
        records = _aiperf_records(out / f"concurrency_{concurrency}")
        assert len(records) == 2 and all(r["status"] == 200 for r in records)
        ids = [r["metadata"]["x_request_id"] for r in records]
        finished = _finished(server.dir / "events.memlog", ids)
        metrics = {
            json.loads(line)["metadata"]["x_request_id"]: json.loads(line)["metrics"]
            for line in (out / f"concurrency_{concurrency}/profile_export.jsonl").open()
        }
        for record, rid in zip(records, ids, strict=True):
            assert record["payload"]["stream_options"]["continuous_usage_stats"] is True
            done, got = finished[rid], metrics[rid]
            assert 1 <= done.completion_tokens <= 64  # aiperf sends no ignore_eos: EOS may end it
            usages = _chunk_usages(record)
            assert len(usages) > done.completion_tokens and None not in usages  # one a chunk
            assert usages[-1]["completion_tokens"] == done.completion_tokens
            assert got["input_sequence_length"]["value"] == done.prompt_tokens
            assert got["output_sequence_length"]["value"] == done.completion_tokens
