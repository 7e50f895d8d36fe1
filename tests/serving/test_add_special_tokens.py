"""vLLM's `add_special_tokens`: the core adds the tokenizer's own special tokens (here a BOS its
post-processor adds) around a text's or a chat's ids when a request asks, and only then; token
ids are taken as given."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers.processors import TemplateProcessing

from memstep.core.config import EngineConfig
from memstep.core.model_source import shipped_gguf_path
from memstep.core.tokenizer import gguf_tokenizer_json
from memstep.events import codec
from memstep.events.types import RequestAdded
from memstep.events.wire import GenerateDone, GenerateRequest, TokenizeReply, TokenizeRequest
from memstep.executors.process.inprocess import local_engine

PARAMS = {"max_tokens": 1, "temperature": 0.0}
BOS = 0  # SmolLM2's <|endoftext|>, which this tokenizer's post-processor puts first
TEXT, CHAT = "The capital of France is", [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer with a post-processor that adds a BOS, as Llama's tokenizers do."""
    raw = RawTokenizer.from_str(gguf_tokenizer_json(shipped_gguf_path()))
    raw.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", BOS)]
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    raw.save(str(path))
    return path


def _ends(reply: object, request_id: str) -> bool:
    """Whether `reply` is the last one the core sends for `request_id`."""
    return isinstance(reply, GenerateDone | TokenizeReply) and reply.request_id == request_id


def test_the_core_adds_the_tokenizers_special_tokens_where_asked(turned_server, bos_tokenizer):
    cfg = EngineConfig(model="smollm2", tokenizer=str(bos_tokenizer), num_threads=1)
    with turned_server(local_engine(cfg)) as (server, s):
        added: list[RequestAdded] = []
        server.engine.sinks.append(lambda e: added.append(e) if isinstance(e, RequestAdded) else 0)
        tok = server.engine.tokenizer
        msgs = [
            GenerateRequest("a", prompt=TEXT, params=PARAMS, add_special_tokens=True),
            GenerateRequest("b", prompt=TEXT, params=PARAMS),
            GenerateRequest("c", messages=CHAT, params=PARAMS, add_special_tokens=True),
            GenerateRequest(
                "d", prompt_token_ids=[5, 6, 7], params=PARAMS, add_special_tokens=True
            ),
            TokenizeRequest("e", prompt=TEXT, add_special_tokens=True),
        ]
        replies: list[object] = []
        for msg in msgs:
            s.send(codec.encode(msg))
            deadline = time.monotonic() + 120  # a loaded CI core: wait on time, not on turns
            while time.monotonic() < deadline:
                server.run_once()
                while s.poll(0):
                    replies.append(codec.decode(s.recv()))
                if any(_ends(r, msg.request_id) for r in replies):
                    break
        assert [e.prompt_token_ids for e in added] == [
            [BOS, *tok.encode(TEXT)],
            tok.encode(TEXT),
            [BOS, *tok.encode_chat(CHAT)],
            [5, 6, 7],
        ]
        (counted,) = [r for r in replies if isinstance(r, TokenizeReply)]
        assert counted.token_ids == [BOS, *tok.encode(TEXT)]
