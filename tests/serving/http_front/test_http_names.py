"""The HTTP front's usage and names: `cached_tokens` of a repeated prompt, and the model's name
from `--served-model-name` in /v1/models and every reply."""

from __future__ import annotations

import json

import httpx
import pytest

from memstep.cli.serve import ServerProcess

NAME = "tiny-served"
PROMPT = "the same long prompt, sent twice so that its full KV pages are cached"  # 70 bytes


@pytest.fixture(scope="module")
def url():
    args = ["--model", "random:tiny", "--num-threads", "1", "--served-model-name", NAME]
    with ServerProcess(args, http=True) as server:
        server.wait_ready()
        yield server.http_url + "/v1"


def _complete(url: str, **extra) -> httpx.Response:
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra}
    return httpx.post(url + "/completions", json=body, timeout=30)


def test_a_repeated_prompt_reports_its_cached_tokens(url):
    first = _complete(url).json()["usage"]
    again = _complete(url).json()["usage"]
    assert first["prompt_tokens"] == again["prompt_tokens"] == len(PROMPT)
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    # the block size is 16: every full page of the prompt but the one holding its last token
    assert again["prompt_tokens_details"]["cached_tokens"] == (len(PROMPT) - 1) // 16 * 16


def test_the_streamed_usage_reports_cached_tokens_too(url):
    _complete(url)
    options = {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST",
        url + "/completions",
        json={"model": NAME, "prompt": PROMPT, "max_tokens": 2, **options},
        timeout=30,
    ) as reply:
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: {")]
    usage = json.loads(events[-1])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_the_served_model_name_is_the_models_name(url):
    models = httpx.get(url + "/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [NAME]
    assert _complete(url).json()["model"] == NAME
    refused = _complete(url, model="random:tiny")  # the --model string is not its name
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
