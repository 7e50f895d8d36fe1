"""A streamed completion's SSE bytes: each choice's chunks from the core's replies, the usage
chunk and `[DONE]` at its end, an error event where the core failed (`SseResponse`)."""

from __future__ import annotations

import collections
from typing import Any

import attrs
import orjson

from memstep.api.client import ServerError
from memstep.events.wire import GenerateDone
from memstep.serving.http_front import openai_protocol as oai
from memstep.serving.http_front.http_errors import error_of
from memstep.serving.http_front.openai_protocol import Job
from memstep.serving.http_front.tool_call_stream import CallStream

DONE = b"data: [DONE]\n\n"


@attrs.define
class SseResponse:
    """One SSE response: what it has sent (each choice's GenerateDone, text offset, first
    chunk) and the bytes each reply of the core adds to it."""

    job: Job
    rid: str
    num_choices: int
    dones: dict[int, GenerateDone] = attrs.Factory(dict)
    offsets: collections.defaultdict[int, int] = attrs.Factory(lambda: collections.defaultdict(int))
    started: set[int] = attrs.Factory(set)  # choices whose first chunk (with the chat role) went
    echoed: set[int] = attrs.Factory(set)  # choices whose prompt went (`echo`)
    ended: bool = False
    calls: collections.defaultdict[int, CallStream] = attrs.Factory(
        lambda self: collections.defaultdict(self.job.call_stream), takes_self=True
    )  # each choice's text split into content and tool-call deltas
    held_logprobs: dict[int, list[list]] = attrs.Factory(dict)  # of tokens held back
    created: int = 0  # the `created` of the chunks of this write (seconds)
    plain: dict[int, oai.TextChunks | None] = attrs.Factory(dict)  # each choice's, once made
    prompt_tokens: list[int] = attrs.Factory(list)  # each prompt's, with continuous usage
    num_tokens: collections.Counter[int] = attrs.Factory(collections.Counter)  # each choice's

    def usage_of(self, index: int, completion_tokens: int) -> dict[str, int] | None:
        """Choice `index`'s usage so far, for its chunk; None unless every chunk carries it."""
        if not self.job.continuous_usage:
            return None
        prompt_tokens = self.prompt_tokens[index // self.job.n]
        return oai.running_usage(prompt_tokens, completion_tokens)

    def text_chunks(self, index: int) -> oai.TextChunks | None:
        """Choice `index`'s plain text chunks, made on its first."""
        if index not in self.plain:
            self.plain[index] = oai.TextChunks.of(self.job, self.rid, index)
        return self.plain[index]

    def role_events(self) -> list[bytes]:
        """Each choice's first chunk of a chat, with its role, before any token."""
        self.started.update(range(self.num_choices))
        return [
            event(oai.role_chunk(self.job, self.rid, i, self.usage_of(i, 0)))
            for i in range(self.num_choices)
        ]

    def events(self, index: int, item: Any) -> bytes:
        """The SSE text for one reply of choice `index`: its chunk; after the last choice's
        GenerateDone the usage chunk if asked for and [DONE]; an error event ends the stream.

        A delta with tokens gets its chunk even when it adds no text (a token that ends inside
        a character, one the tokenizer has no text for, text held back by a stop string), as
        vLLM's server sends one: a client times each token as it comes, and the first chunk is
        the first token, as over ZMQ.  Held back, a random model's reply whose tokens have no
        text would show its first chunk, and its TTFT, only at its end."""
        job, rid = self.job, self.rid
        if self.ended:
            return b""
        if isinstance(item, ServerError):
            self.ended = True
            return event(error_of(item).body()) + DONE
        if isinstance(item, GenerateDone):
            self.dones[index] = item
            held, called, left = b"", False, []
            if job.calls_tools:
                calls, waiting = self.calls[index], self.held_logprobs.pop(index, [])
                cut = job.cut_call(item.finish_reason)
                held = self._tool_chunks(index, calls.finish(cut), waiting)
                called, left = calls.num_calls > 0, self.held_logprobs.pop(index, [])
            echo, left = self._echo(index, item, "", left)
            used = self.usage_of(index, item.usage.completion_tokens)
            end = oai.chunk(
                job, rid, index, echo, left, self.offsets[index], usage=used, **finish(item, called)
            )
            data = held + event(end)
            if len(self.dones) == self.num_choices:
                self.ended = True
                if job.include_usage:
                    ordered = [self.dones[i] for i in range(self.num_choices)]
                    data += event(oai.usage_chunk(job, rid, ordered))
                data += DONE
            return data
        self.num_tokens[index] += len(item.token_ids)
        if job.calls_tools:
            waiting = self.held_logprobs.pop(index, []) + list(item.logprobs)
            return self._tool_chunks(index, self.calls[index].feed(item.text), waiting)
        if job.echo_only and index in self.started:  # the prompt went; no reply to show
            return b""
        text, logprobs = self._echo(index, item, item.text, item.logprobs)
        if not (text or item.token_ids or logprobs):
            return b""
        role = index not in self.started
        self.started.add(index)
        offset = self.offsets[index]
        self.offsets[index] += len(text)
        used = self.usage_of(index, self.num_tokens[index])
        if not (role or logprobs or used) and (plain := self.text_chunks(index)) is not None:
            return plain.event(text, self.created)
        return event(oai.chunk(job, rid, index, text, logprobs, offset, role=role, usage=used))

    def _echo(
        self, index: int, item: Any, text: str, logprobs: list[list]
    ) -> tuple[str, list[list]]:
        """A choice's first chunk with `echo`: the prompt (and its logprobs) before the reply's;
        a later one as it is."""
        if not self.job.echo or index in self.echoed:
            return text, logprobs
        self.echoed.add(index)
        return oai.echoed(self.job, index, item.prompt_logprobs, text, logprobs)

    def _tool_chunks(self, index: int, deltas: list[dict[str, Any]], logprobs: list[list]) -> bytes:
        """The chunks of a choice that may call tools: its content and tool-call deltas
        (serving/http_front/tool_call_stream.py), the tokens' logprobs on the first of them; with no
        delta to send, the logprobs wait for the next."""
        if not deltas:
            if logprobs:
                self.held_logprobs[index] = logprobs
            return b""
        chunks, job, rid = [], self.job, self.rid
        used = self.usage_of(index, self.num_tokens[index])
        for delta in deltas:
            if "content" in delta:
                chunk = oai.chunk(job, rid, index, delta["content"], logprobs, 0, usage=used)
            else:
                chunk = oai.calls_chunk(job, rid, index, delta["tool_calls"], logprobs, used)
            chunks.append(event(chunk))
            logprobs = []
        return b"".join(chunks)


def finish(done: GenerateDone, called: bool = False) -> dict[str, Any]:
    """A choice's finish_reason: "tool_calls" where it stopped after calling one."""
    if called and done.finish_reason == "stop":
        return {"finish_reason": "tool_calls"}
    return {"finish_reason": done.finish_reason}


def event(obj: dict[str, Any]) -> bytes:
    """One SSE event of a JSON object."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"
