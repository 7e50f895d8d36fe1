"""Every family served: a tiny random checkpoint of each (tests/executors/model/tiny_families.py)
with SmolLM2's real tokenizer and the family's real chat template (chat_templates/ here, from
the models' tokenizer_config.json), served by `memstep serve --model DIR` and answered through
the `openai` SDK: a chat, a streamed chat, and a forced tool call, whole and streamed,
returned as `tool_calls` in the format the template teaches (a random model calls a tool only
under the grammar). The server's log then replays identically.

One server a family, in turn; tiny dimensions, a few tokens a request. Four families run in the
suite (one a tool-call format, and a template without tools); the other three with `-m slow`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from memstep.cli.serve import ServerProcess
from memstep.core.model_source import shipped_gguf_path
from memstep.core.tokenizer import gguf_tokenizer_folder
from memstep.replay.recording import load
from memstep.replay.replayer import replay
from memstep.replay.report import build_report
from tests.executors.model.tiny_families import make_checkpoint

TEMPLATES = Path(__file__).parent / "chat_templates"
SMOL_VOCAB = 49152  # SmolLM2's tokenizer: the checkpoints' vocabulary is its
# family -> (model_type, chat template, the tool-call format the server should pick)
FAMILIES = {
    "qwen2": ("qwen2", "qwen2", "hermes"),
    "qwen3": ("qwen3", "qwen3", "hermes"),
    "qwen3_moe": ("qwen3_moe", "qwen3", "hermes"),
    "llama": ("llama", "llama", "llama3_json"),
    "mistral": ("mistral", "mistral", "mistral"),
    "gemma3": ("gemma3_text", "gemma3", "hermes"),
    "phi3": ("phi3", "phi3", "hermes"),
    "mixtral": ("mixtral", "mixtral", "hermes"),
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# templates without tools: memstep's own prompt carries them
OWN_PROMPT = ("gemma3", "phi3", "mixtral")


@pytest.fixture(scope="module")
def smol_tokenizer(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer as a folder (tokenizer.json, tokenizer_config.json), made once."""
    folder = tmp_path_factory.mktemp("smol-tokenizer")
    gguf_tokenizer_folder(shipped_gguf_path(), folder)
    return folder


def checkpoint(family: str, folder: Path, tokenizer: Path) -> None:
    """The family's tiny checkpoint in `folder`, the `tokenizer` folder's files beside it with
    the family's chat template."""
    model_type, template, _ = FAMILIES[family]
    make_checkpoint(model_type, folder, vocab_size=SMOL_VOCAB, tie_word_embeddings=True)
    shutil.copy(tokenizer / "tokenizer.json", folder)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / f"{template}.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _replays_identically(log: Path) -> None:
    """The log replayed here (the in-process executor, as `memstep replay` runs it)."""
    recording = load(log)
    report = build_report(recording, replay(recording, {}), {})
    assert report.exit_code == 0, report.to_text()


# one family a format and a template kind in the suite; the rest (each ~15 s of CPU) with -m slow
SLOW = ("qwen2", "qwen3_moe", "phi3", "mixtral")


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in FAMILIES]
)
def test_a_family_serves_chat_streams_and_tool_calls_and_its_log_replays(
    family, tmp_path, smol_tokenizer
):
    checkpoint(family, tmp_path / "model", smol_tokenizer)
    args = ["--model", str(tmp_path / "model"), "--max-model-len", "512", "--seed", "1"]
    args += ["--num-threads", "1"]
    args += ["--log-level", "info"]
    with ServerProcess(args, http=True) as server:
        server.wait_ready(timeout=300)
        sdk = openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0)
        model = sdk.models.list().data[0].id
        _chats(sdk, model)
        _forced_calls(sdk, model)
        _, template, parser = FAMILIES[family]
        picked = f"parser={parser} tools_in_template={template not in OWN_PROMPT}"
        assert picked in server.log(), server.log()[-2000:]
        server.stop()
        _replays_identically(server.dir / "events.memlog")


def _chats(sdk: openai.OpenAI, model: str) -> None:
    reply = sdk.chat.completions.create(model=model, messages=ASK, max_tokens=6, seed=3)
    assert reply.choices[0].message.content is not None and reply.usage.completion_tokens >= 1
    chunks = list(
        sdk.chat.completions.create(model=model, messages=ASK, max_tokens=6, seed=3, stream=True)
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content


def _forced_calls(sdk: openai.OpenAI, model: str) -> None:
    """A forced call (required, one at a time) comes back as tool_calls, its arguments valid;
    streamed, the same call."""
    kw = dict(model=model, messages=ASK, tools=[WEATHER], tool_choice="required", seed=5)
    kw |= dict(parallel_tool_calls=False, max_tokens=80)
    choice = sdk.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")
    state = ChatCompletionStreamState()
    for chunk in sdk.chat.completions.create(**kw, stream=True):
        state.handle_chunk(chunk)
    (streamed,) = state.get_final_completion().choices[0].message.tool_calls
    assert streamed.function.name == call.function.name
    assert streamed.function.arguments == call.function.arguments
