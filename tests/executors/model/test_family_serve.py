"""`memstep serve --model DIR` of a family other than Llama (a tiny Qwen3 checkpoint) answers the
official `openai` SDK: a chat, the same chat streamed, and a completion whose tokens are
transformers' greedy ones."""

from __future__ import annotations

import json

import openai
import pytest
from tiny_families import hf_greedy, make_checkpoint, write_tokenizer

from memstep.cli.serve import ServerProcess

pytest.importorskip("transformers")

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
PROMPT = [5, 9, 13, 17, 21]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3")
    hf = make_checkpoint("qwen3", folder)
    write_tokenizer(folder)
    config = {"bos_token": None, "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    args = ["--model", str(folder), "--dtype", "float32", "--num-threads", "1", "--no-record"]
    with ServerProcess(args, http=True) as proc:
        proc.wait_ready(timeout=300)
        sdk = openai.OpenAI(base_url=proc.http_url + "/v1", api_key="none", max_retries=0)
        yield sdk, hf, str(folder)


def test_chat_and_its_stream_say_the_same(served):
    sdk, _, name = served
    messages = [{"role": "user", "content": "t5 t9 t13"}]
    chat = sdk.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=8)
    stream = sdk.chat.completions.create(
        model=name, messages=messages, temperature=0, max_tokens=8, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert chat.usage.completion_tokens == 8 and chat.choices[0].message.content == streamed


def test_completion_tokens_are_transformers_greedy(served):
    sdk, hf, name = served
    prompt = " ".join(f"t{i}" for i in PROMPT)
    done = sdk.completions.create(
        model=name, prompt=prompt, temperature=0, max_tokens=8, logprobs=1
    )
    assert done.usage.prompt_tokens == len(PROMPT)
    tokens = [int(t.removeprefix("t")) for t in done.choices[0].logprobs.tokens]
    assert tokens == hf_greedy(hf, PROMPT, 8)
