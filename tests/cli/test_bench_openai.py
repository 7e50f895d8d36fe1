"""`bench serve --backend openai|openai-chat`: the same load over memstep's HTTP front."""

from __future__ import annotations

import asyncio
import json

import pytest

from memstep.cli import bench_openai, bench_serve
from memstep.cli.serve import ServerProcess

TINY = ["--model", "random:tiny", "--num-threads", "1"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(TINY, http=True) as proc:
        proc.wait_ready()
        yield proc


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_bench_serve_over_http_reports_every_request(server, backend, tmp_path, capsys):
    out = tmp_path / "bench.json"
    url = server.http_url + ("/v1" if backend == "openai-chat" else "")  # as `serve` prints it
    argv = ["--backend", backend, "--base-url", url, "--dataset", "synthetic"]
    argv += ["--num-prompts", "6", "--max-output-len", "8", "--ignore-eos", "--json", str(out)]
    argv += ["--max-concurrency", "3", *TINY]
    assert bench_serve.main(argv) == 0
    assert "Successful requests:                    6" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert (data["completed"], data["failed"], data["total_output_tokens"]) == (6, 0, 6 * 8)
    assert all(n > 0 for n in data["requests"]["input_lens"])
    assert 0 < data["median_ttft_ms"] <= data["median_e2el_ms"]


def test_http_errors_count_as_failed_requests(server, tmp_path, capsys):
    rows = [{"prompt": "a short one", "output_len": 4}, {"prompt": "x" * 600, "output_len": 4}]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(json.dumps(r) for r in rows))
    argv = ["--backend", "openai", "--base-url", server.http_url, "--dataset", str(dataset)]
    argv += ["--num-prompts", "2", *TINY]
    out = tmp_path / "bench.json"
    assert bench_serve.main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["completed"], data["failed"]) == (1, 1)
    assert "HTTP 400" in data["requests"]["errors"][1]


def test_the_client_times_every_token_also_one_without_text(server):
    """Every chunk of a choice is an arrival, with text or without (as vLLM's client times them),
    so TTFT is the first token's; only a closing chunk with no text is not one.  The check fires:
    counting chunks with text only, random:tiny's bytes of unfinished characters go untimed."""
    body = bench_openai.request_body(False, "random:tiny", "abc", 24, True)
    body |= {"temperature": 1.0, "seed": 3}  # some tokens without text (see tests/serving)

    async def run() -> bench_openai.Streamed:
        async with bench_openai.session(60) as http:
            return await bench_openai.stream(http, server.http_url, False, body)

    got = asyncio.run(run())
    assert len(got.arrivals) == got.completion_tokens == 24
    assert bench_openai.is_token({"text": "", "finish_reason": None}, False)
    assert not bench_openai.is_token({"delta": {"content": ""}, "finish_reason": "length"}, True)
    assert bench_openai.is_token({"delta": {"content": "a"}, "finish_reason": "stop"}, True)
