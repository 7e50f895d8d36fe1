"""OpenAI's completions and chat completions, as JSON maps: requests in, responses out.

`parse_completion` and `parse_chat` turn a request body into a `Job`: the prompts to run, the
sampling params each choice sends over the ZMQ API, and how to shape the answer.  Anything the
engine cannot honour is refused with an `OpenAIError` (HTTP status and OpenAI's error object)
rather than silently ignored.  The response builders take the API's `GenerateDone` and
`GenerateDelta` records; their field names follow OpenAI's API reference.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import attrs
import orjson

from memstep.events.wire import GenerateDone, TokenizeReply, TokenizeRequest
from memstep.serving.http_front import vllm_fields
from memstep.serving.http_front.tool_call_stream import CallStream, split_reply
from memstep.serving.http_front.tool_calls import (
    ToolError,
    Tools,
    calls_message,
    parse_calls,
    parse_tools,
)
from memstep.serving.http_front.tool_parsers import DEFAULT_FORMAT, ToolFormat

# What each request field of OpenAI (and vLLM's extras) becomes in the engine's SamplingParams.
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "min_tokens": "min_tokens",
    "stop_token_ids": "stop_token_ids",
    "logit_bias": "logit_bias",
    "include_stop_str_in_output": "include_stop_str_in_output",
}
COMMON_FIELDS = {"model", "n", "stream", "stream_options", "stop", "max_tokens", "user"}
# OpenAI's fields about its own storage and billing: taken, and nothing to do here
IGNORED_FIELDS = {"store", "metadata", "service_tier"}
# OpenAI's and vLLM's fields the engine does not serve: refused by name
UNSUPPORTED_FIELDS = {
    "suffix",
    "functions",
    "function_call",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
}
COMMON_FIELDS |= IGNORED_FIELDS
# structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* fields
GUIDED_FIELDS = {
    "guided_json": "guided_json",
    "guided_regex": "guided_regex",
    "guided_choice": "guided_choice",
    "guided_grammar": "guided_grammar",
}
STRUCTURED_KEYS = {
    "json": "guided_json",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
    "json_object": "guided_json_object",
}
COMMON_FIELDS |= set(SAMPLING_FIELDS) | set(GUIDED_FIELDS) | {"response_format"}
COMMON_FIELDS |= {"structured_outputs", "prompt_logprobs", "skip_special_tokens"}
COMMON_FIELDS |= {"max_completion_tokens", "add_special_tokens"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of"}
COMPLETION_FIELDS |= set(vllm_fields.COMPLETION_FIELDS)
CHAT_FIELDS = COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "chat_template_kwargs"}
CHAT_FIELDS |= {"tools", "tool_choice", "parallel_tool_calls"} | set(vllm_fields.CHAT_FIELDS)
MAX_N = 16
MAX_STOP = 256  # stop strings a request may give (vLLM sets no limit; OpenAI's is 4)


class OpenAIError(Exception):
    """A request that fails; `body()` is OpenAI's error object, `status` its HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", **extra):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = extra.get("param")
        self.code = extra.get("code")

    def body(self) -> dict[str, Any]:
        error = {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}
        return {"error": error}


def bad(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


@attrs.frozen
class Job:
    """One HTTP request's work: each prompt runs `n` times, each run is one choice."""

    chat: bool
    model: str
    prompts: list[dict[str, Any]]  # GenerateRequest's source: {"prompt": ...} or {"messages": ...}
    params: list[dict[str, Any]]  # per choice, prompt-major: prompts[i // n] with params[i]
    n: int
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs in the answer
    tools: Tools | None = None  # a chat's tools, when it may call them
    echo: bool = False  # completions: each choice's text and logprobs begin with its prompt's
    echo_only: bool = False  # echo with max_tokens 0: the prompt's alone (one token generated)
    prompt_logprobs: int | None = None  # vLLM's field: each prompt token's score, rank, top N
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage on every chunk

    @property
    def calls_tools(self) -> bool:
        return self.tools is not None and self.tools.is_on

    @property
    def forces_call(self) -> bool:
        """Whether a grammar forces a tool call (tool_choice required or a named function)."""
        return self.tools is not None and self.tools.is_on and self.tools.grammar() is not None

    def call_stream(self) -> CallStream:
        """A choice's reply split as it streams, in the format of the calls it may make."""
        return CallStream((self.tools.format if self.tools else DEFAULT_FORMAT).parser.syntax)

    def cut_call(self, finish_reason: str) -> bool:
        """Whether a reply is a forced call that max_tokens cut short: its shape is then the
        calls whose name was complete (arguments as far as written), content null."""
        return finish_reason == "length" and self.forces_call

    @property
    def num_choices(self) -> int:
        return len(self.params)

    def prompt_of(self, choice: int) -> dict[str, Any]:
        return self.prompts[choice // self.n]


# --- requests ------------------------------------------------------------------------------


def parse_completion(body: Any, model: str) -> Job:
    body = _object(body, COMPLETION_FIELDS, vllm_fields.COMPLETION_FIELDS)
    if body.get("best_of") not in (None, 1):
        raise bad("best_of other than 1 is not supported", "best_of")
    top = _int(body, "logprobs", 0, 5)
    prompts = [{"prompt": p} | _special_tokens(body, True) for p in _prompts(body.get("prompt"))]
    max_tokens, echo = _max_tokens(body, 0), _bool(body, "echo")
    if max_tokens == 0 and not echo:
        raise bad("max_tokens 0 needs echo: true (the prompt alone)", "max_tokens")
    # echo with max_tokens 0 (vLLM's): one token generated and left out of the answer
    job = _job(body, model, False, prompts, 16 if max_tokens is None else max(max_tokens, 1), top)
    if not echo:
        return job
    # the prompt's tokens scored as the reply's are; a prompt of ids is scored for its texts
    params = [
        p | {"prompt_logprobs": max(top or 0, p.get("prompt_logprobs") or 0)}
        if top is not None or not isinstance(job.prompt_of(i)["prompt"], str)
        else p
        for i, p in enumerate(job.params)
    ]
    return attrs.evolve(job, params=params, echo=True, echo_only=max_tokens == 0)


def parse_chat(body: Any, model: str, tool_format: ToolFormat = DEFAULT_FORMAT) -> Job:
    """A chat completion; tools are called in `tool_format` (the server's)."""
    body = _object(body, CHAT_FIELDS, vllm_fields.CHAT_FIELDS)
    messages = _messages(body.get("messages"), tool_format)
    try:
        tools = parse_tools(body, tool_format)
    except ToolError as exc:
        raise bad(str(exc), "tools") from exc
    extra = body.get("chat_template_kwargs")
    if tools is not None and tools.is_on and not tool_format.in_template:
        messages = _with_tools(messages, tools, tool_format.system_turn)
    top = _int(body, "top_logprobs", 0, 20)
    if not body.get("logprobs"):
        if top:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        top = None
    elif top is None:
        top = 0
    max_tokens = _max_tokens(body, 1)
    source: dict[str, Any] = {"messages": messages} | _special_tokens(body, False)
    if extra is not None and not isinstance(extra, dict):
        raise bad("chat_template_kwargs must be an object", "chat_template_kwargs")
    if tools is not None and tools.is_on and tool_format.in_template:
        extra = {**(extra or {}), "tools": tools.listed()}  # the template writes them
    if extra is not None:  # vLLM's: more variables for the template, e.g. enable_thinking
        source["chat_template_kwargs"] = extra
    return _job(body, model, True, [source], max_tokens, top, tools)


def _special_tokens(body: dict, default: bool) -> dict[str, bool]:
    """vLLM's add_special_tokens: true adds the tokenizer's own special tokens (a BOS, say;
    SmolLM2's adds none) around the prompt's ids, on top of a chat template's; false, none.
    Absent, vLLM's `default`: true for a completion's text (Llama's and Gemma's BOS, as their
    tokenizers add it), false for a chat (its template writes them)."""
    given = body.get("add_special_tokens")
    if not (default if given is None else _bool(body, "add_special_tokens")):
        return {}
    return {"add_special_tokens": True}


def _max_tokens(body: dict, low: int) -> int | None:
    """OpenAI's max_completion_tokens, or its older name max_tokens (both endpoints, as vLLM)."""
    given = _int(body, "max_completion_tokens", low, None)
    return given if given is not None else _int(body, "max_tokens", low, None)


def parse_tokenize(body: Any, model: str) -> TokenizeRequest:
    """vLLM's /tokenize: a raw `prompt`, or chat `messages` read as a chat completion would
    (`add_generation_prompt` true: the only form the engine reads them in)."""
    fields = {"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens"}
    body = _object(body, fields | {"chat_template_kwargs"})
    _model(body, model)
    if body.get("add_generation_prompt") is False:
        raise bad("add_generation_prompt false is not supported", "add_generation_prompt")
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict) or (extra and "messages" not in body):
        raise bad("chat_template_kwargs must be an object, with messages", "chat_template_kwargs")
    if ("prompt" in body) == ("messages" in body):
        raise bad("give exactly one of prompt, messages")
    added = bool(_special_tokens(body, "prompt" in body))  # vLLM's defaults, as above
    if "messages" in body:
        messages = _messages(body["messages"])
        return TokenizeRequest(
            "", messages=messages, chat_template_kwargs=extra, add_special_tokens=added
        )
    if not isinstance(body["prompt"], str):
        raise bad("prompt must be a string", "prompt")
    return TokenizeRequest("", prompt=body["prompt"], add_special_tokens=added)


def parse_detokenize(body: Any, model: str) -> TokenizeRequest:
    """vLLM's /detokenize: the text of `tokens`."""
    body = _object(body, {"model", "tokens"})
    _model(body, model)
    tokens = body.get("tokens")
    if not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
        raise bad("tokens must be a list of token ids", "tokens")
    return TokenizeRequest("", token_ids=tokens)


def tokenized(reply: TokenizeReply) -> dict[str, Any]:
    ids = reply.token_ids
    return {"count": len(ids), "max_model_len": reply.max_model_len, "tokens": ids}


def detokenized(reply: TokenizeReply) -> dict[str, Any]:
    return {"prompt": reply.text}


def tokenizer_info(reply: TokenizeReply) -> dict[str, Any]:
    return dict(reply.config)


def _with_tools(
    messages: list[dict[str, str]], tools: Tools, system_turn: bool = True
) -> list[dict[str, str]]:
    """The tools' system prompt, before (or joined to) the conversation's own system turn; where
    the template takes no system turn, at the head of the first turn."""
    prompt = tools.system_prompt()
    if messages[0]["role"] == "system":
        first = {"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}
        return [first, *messages[1:]]
    if not system_turn:
        first = {**messages[0], "content": f"{prompt}\n\n{messages[0]['content']}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _job(
    body: dict,
    model: str,
    chat: bool,
    prompts: list,
    max_tokens: int | None,
    top: int | None,
    tools: Tools | None = None,
) -> Job:
    _model(body, model)
    n = _int(body, "n", 1, MAX_N) or 1
    stream = _bool(body, "stream")
    options = _stream_options(body.get("stream_options"), stream)
    if body.get("skip_special_tokens") is not None and not _bool(body, "skip_special_tokens"):
        # vLLM's default, true, is how every text here is made: special tokens give no text
        raise bad("skip_special_tokens false is not supported", "skip_special_tokens")
    scored = _int(body, "prompt_logprobs", 0, 20)
    if scored is not None and stream:
        raise bad("prompt_logprobs is not available with stream: true", "prompt_logprobs")
    base = _sampling(body, max_tokens, top) | _constraint(body, tools)
    if scored is not None:
        base["prompt_logprobs"] = scored
    params = [_choice_params(base, body.get("seed"), j) for _ in prompts for j in range(n)]
    usage = bool(options.get("include_usage"))
    every = usage and bool(options.get("continuous_usage_stats"))  # as vLLM: with include_usage
    return Job(
        chat,
        model,
        prompts,
        params,
        n,
        stream,
        usage,
        top,
        tools,
        prompt_logprobs=scored,
        continuous_usage=every,
    )


def _stream_options(options: Any, stream: bool) -> dict[str, Any]:
    """OpenAI's include_usage (a usage chunk at the end) and vLLM's continuous_usage_stats
    (usage on every chunk as well), each a boolean."""
    if options is None:
        return {}
    keys = {"include_usage", "continuous_usage_stats"}
    if not isinstance(options, dict) or set(options) - keys:
        raise bad("stream_options takes only include_usage and continuous_usage_stats")
    if options and not stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    for key, value in options.items():
        if not isinstance(value, bool | None):
            raise bad(f"stream_options.{key} must be a boolean", "stream_options")
    return options


def _constraint(body: dict, tools: Tools | None) -> dict[str, Any]:
    """The structured-output params the request asks for, at most one (the engine checks that
    it compiles, and refuses it with the reason where it does not)."""
    given: dict[str, Any] = {}
    for field, name in GUIDED_FIELDS.items():
        if body.get(field) is not None:
            given[name] = body[field]
    given |= _structured_outputs(body.get("structured_outputs"))
    given |= _response_format(body.get("response_format"))
    grammar = tools.grammar() if tools is not None and tools.is_on else None
    if grammar is not None:
        if given:
            raise bad("a forced tool call takes no other structured output", "tool_choice")
        given["guided_grammar"] = grammar
    if len(given) > 1:
        raise bad(f"at most one structured-output constraint, got {sorted(given)}")
    if given.get("guided_choice") == []:
        raise bad("guided_choice is empty: give at least one string", "guided_choice")
    if isinstance(given.get("guided_json"), dict):
        given["guided_json"] = json.dumps(given["guided_json"])
    return given


def _structured_outputs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or set(value) - set(STRUCTURED_KEYS):
        keys = sorted(STRUCTURED_KEYS)
        raise bad(f"structured_outputs takes one of {keys}", "structured_outputs")
    return {STRUCTURED_KEYS[k]: v for k, v in value.items() if v not in (None, False)}


def _response_format(value: Any) -> dict[str, Any]:
    """OpenAI's response_format: text, json_object, or json_schema (its `schema`; strict or not,
    the text always matches it)."""
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"guided_json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad("response_format json_schema needs json_schema.schema", "response_format")
        return {"guided_json": spec["schema"]}
    raise bad("response_format type must be text, json_object or json_schema", "response_format")


def _sampling(body: dict, max_tokens: int | None, top: int | None) -> dict[str, Any]:
    params: dict[str, Any] = {}  # the engine's defaults are OpenAI's
    for field, name in SAMPLING_FIELDS.items():
        if body.get(field) is not None:
            params[name] = body[field]
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    if top is not None:
        params["logprobs"] = max(top, 1)  # the chosen token's logprob comes with the top ones
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not (isinstance(stops, list) and all(isinstance(x, str) for x in stops)):
            raise bad("stop must be a string or a list of strings", "stop")
        if len(stops) > MAX_STOP:
            raise bad(f"stop takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
        params["stop"] = stops
    return params


def _model(body: dict, model: str) -> None:
    name = body.get("model", model)
    if name != model:
        raise OpenAIError(404, f"The model `{name}` does not exist.", code="model_not_found")


def _choice_params(base: dict[str, Any], seed: Any, j: int) -> dict[str, Any]:
    """Choice j's params: a given seed + j (reproducible, yet distinct choices); without one,
    the engine draws each choice's seed from its own (`--seed`), as for a ZMQ request."""
    if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0:
        return {**base, "seed": seed + j}
    return base


def _object(body: Any, allowed: set[str], vllm: dict | None = None) -> dict[str, Any]:
    """The body as a map of known fields; vLLM's that ask for what is not done, refused."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        name = unknown[0]
        if name in UNSUPPORTED_FIELDS:
            raise bad(f"{name} is not supported", name)
        raise bad(f"Unrecognized request argument supplied: {name}", name)
    refused = vllm_fields.refusal(body, vllm or {})
    if refused is not None:
        raise bad(refused[1], refused[0])
    return body


def _int(body: dict, field: str, low: int, high: int | None) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(f"{field} must be an integer", field)
    if value < low or (high is not None and value > high):
        where = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise bad(f"{field} must be {where}, got {value}", field)
    return value


def _bool(body: dict, field: str) -> bool:
    value = body.get(field, False)
    if not isinstance(value, bool):
        raise bad(f"{field} must be a boolean", field)
    return value


def _prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's prompt: a string, a list of strings, token ids, or a list of token id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return list(prompt)
    raise bad("prompt must be a string, a list of strings, or token ids", "prompt")


def _messages(messages: Any, fmt: ToolFormat = DEFAULT_FORMAT) -> list[dict[str, str]]:
    """The conversation as role and content; tool calls and results as the model reads them in
    `fmt` (a template that renders tools wraps a result itself)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    return [_message(m, fmt) for m in messages]


def _message(m: Any, fmt: ToolFormat) -> dict[str, str]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad("each message needs a role", "messages")
    content = m.get("content")
    if m.get("tool_calls"):  # an assistant turn that called tools: the calls as the model wrote
        try:
            calls = calls_message(m, fmt.parser)
        except (ValueError, TypeError, AttributeError) as exc:
            raise bad(f"tool_calls of a message do not parse: {exc}", "messages") from exc
        return {"role": m["role"], "content": "\n".join(filter(None, [content or "", calls]))}
    if m["role"] == "tool" and isinstance(content, str) and not fmt.in_template:
        return {"role": "tool", "content": f"<tool_response>\n{content}\n</tool_response>"}
    if isinstance(content, list):  # content parts: only text is understood
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise bad("only text content parts are supported", "messages")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise bad("message content must be a string or text parts", "messages")
    return {"role": m["role"], "content": content}


# --- responses -----------------------------------------------------------------------------


def new_id(chat: bool, client_id: str | None = None) -> str:
    """The response's id: from the client's `X-Request-Id` when it gave one, else random."""
    return ("chatcmpl-" if chat else "cmpl-") + (client_id or uuid.uuid4().hex)


def usage(job: Job, dones: list[GenerateDone]) -> dict[str, Any]:
    """OpenAI's usage of all choices: each prompt counted once (its first choice), with the
    prompt tokens the prefix cache held as `prompt_tokens_details.cached_tokens`."""
    firsts = dones[:: job.n]
    prompt_tokens = sum(d.usage.prompt_tokens for d in firsts)
    completion_tokens = 0 if job.echo_only else sum(d.usage.completion_tokens for d in dones)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(d.usage.cached_tokens for d in firsts)},
    }


def response(job: Job, rid: str, dones: list[GenerateDone]) -> dict[str, Any]:
    """The whole answer of a non-streaming request, its choices in index order."""
    choices = [_choice(job, i, d) for i, d in enumerate(dones)]
    kind = "chat.completion" if job.chat else "text_completion"
    answer = {**_head(job, rid, kind), "choices": choices, "usage": usage(job, dones)}
    if job.chat and job.prompt_logprobs is not None:  # vLLM's: the one prompt's, beside them
        answer["prompt_logprobs"] = vllm_prompt_logprobs(dones[0].prompt_logprobs, job)
    return answer


def _choice(job: Job, index: int, done: GenerateDone) -> dict[str, Any]:
    logprobs = format_logprobs(job, done.logprobs, 0)
    if job.chat:
        message: dict[str, Any] = {"role": "assistant", "content": done.text}
        reason = done.finish_reason
        parser = (job.tools.format if job.tools else DEFAULT_FORMAT).parser
        if job.cut_call(reason):
            content, calls = split_reply(done.text, parser.syntax, cut=True)
            message = {"role": "assistant", "content": content or None, "tool_calls": calls}
        elif job.calls_tools:
            content, calls = parse_calls(done.text, parser)
            if calls:
                message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                reason = "tool_calls" if reason == "stop" else reason
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
    text = done.text
    if job.echo:
        text, tokens = echoed(job, index, done.prompt_logprobs, text, done.logprobs)
        logprobs = format_logprobs(job, tokens, 0)
    reason = done.finish_reason
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    if job.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(done.prompt_logprobs, job)
    return choice


def echoed(
    job: Job, index: int, scored: list[list], text: str, tokens: list[list]
) -> tuple[str, list[list]]:
    """Choice `index`'s text and logprob entries as `echo` gives them: the prompt's (`scored`,
    its prompt logprobs) before the reply's `text` and `tokens`, the reply's left out where
    max_tokens was 0. A prompt given as ids comes back as its tokens' texts."""
    if job.echo_only:
        text, tokens = "", []
    prompt = job.prompt_of(index)["prompt"]
    if not isinstance(prompt, str):
        prompt = "".join(entry[1] for entry in scored)
    if job.top_logprobs is None:
        return prompt + text, []
    return prompt + text, [entry[:4] for entry in scored] + list(tokens)


def vllm_prompt_logprobs(scored: list[list], job: Job) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` answer: None for the first token, then per prompt token a map
    from token id to {logprob, rank, decoded_token}: the token's own, then the top N the
    request asked for (ranked 1..N)."""
    top = job.prompt_logprobs or 0
    answer: list[dict[str, Any] | None] = [None]
    for token, text, logprob, alternatives, rank in scored[1:]:
        entry = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": text}}
        for i, (tid, alt_text, alt_logprob) in enumerate(alternatives[:top]):
            entry.setdefault(
                str(tid), {"logprob": alt_logprob, "rank": i + 1, "decoded_token": alt_text}
            )
        answer.append(entry)
    return answer


def chunk(
    job: Job, rid: str, index: int, text: str, logprobs: list[list], offset: int, **extra: Any
) -> dict[str, Any]:
    """One streamed chunk of choice `index`; `extra` may set finish_reason, the chat role, and
    the `usage` of a continuous_usage_stats stream."""
    lp = format_logprobs(job, logprobs, offset)
    reason = extra.get("finish_reason")
    if job.chat:
        delta: dict[str, Any] = {"role": "assistant"} if extra.get("role") else {}
        delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        out = {**_head(job, rid, "chat.completion.chunk"), "choices": [choice]}
    else:
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
        out = {**_head(job, rid, "text_completion"), "choices": [choice]}
    if job.include_usage:
        out["usage"] = extra.get("usage")
    return out


def role_chunk(job: Job, rid: str, index: int, usage: dict[str, int] | None) -> dict[str, Any]:
    """A chat stream's first chunk of choice `index`: the role alone (content ""), before any
    token, as OpenAI and vLLM send it."""
    return chunk(job, rid, index, "", [], 0, role=True, usage=usage)


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """A choice's usage so far, as vLLM's continuous_usage_stats puts it on each chunk."""
    total = prompt_tokens + completion_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": total,
    }


class TextChunks:
    """The SSE events of one choice's plain text chunks (no role, logprobs or finish reason) as
    bytes: `chunk`'s JSON made once, its text and `created` spliced in per event (orjson writes
    a map's keys in order, compactly), so a streamed token costs one `orjson.dumps` of its text.
    `of` gives None where the JSON cannot be split so (the model's name holds the marker)."""

    MARK = "\ue000memstep-text\ue000"

    def __init__(self, head: bytes, mid: bytes, tail: bytes):
        self.head, self.mid, self.tail = head, mid, tail

    @classmethod
    def of(cls, job: Job, rid: str, index: int) -> TextChunks | None:
        whole = orjson.dumps(chunk(job, rid, index, cls.MARK, [], 0))
        parts = whole.split(orjson.dumps(cls.MARK))
        key = b'"created":'
        if len(parts) != 2 or parts[0].count(key) != 1:
            return None
        before, after = parts[0].split(key)
        mid = after[after.index(b",") :]  # from the comma after the number
        return cls(b"data: " + before + key, mid, parts[1] + b"\n\n")

    def event(self, text: str, created: int) -> bytes:
        """`data: <chunk(...) with this text>` and the blank line, as `_event` writes it."""
        return b"".join((self.head, b"%d" % created, self.mid, orjson.dumps(text), self.tail))


def calls_chunk(
    job: Job,
    rid: str,
    index: int,
    deltas: list[dict[str, Any]],
    logprobs: list[list],
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A streamed chat chunk with tool-call deltas, as OpenAI sends them: a call's first with
    its index, id, type, name and empty arguments, then fragments of its arguments."""
    delta: dict[str, Any] = {"content": None, "tool_calls": deltas}
    lp = format_logprobs(job, logprobs, 0)
    choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}
    out = {**_head(job, rid, "chat.completion.chunk"), "choices": [choice]}
    if job.include_usage:
        out["usage"] = usage
    return out


def usage_chunk(job: Job, rid: str, dones: list[GenerateDone]) -> dict[str, Any]:
    kind = "chat.completion.chunk" if job.chat else "text_completion"
    return {
        **_head(job, rid, kind),
        "choices": [],
        "usage": usage(job, dones),
    }


def _head(job: Job, rid: str, kind: str) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": job.model}


def format_logprobs(job: Job, tokens: list[list], offset: int) -> dict[str, Any] | None:
    """OpenAI's logprobs object from the API's [id, text, logprob, [[id, text, logprob]...]]
    per token; `offset` is the text offset of the first token (completions only)."""
    if job.top_logprobs is None:
        return None
    top = job.top_logprobs
    if job.chat:
        content = [
            {**_token(text, lp), "top_logprobs": [_token(t, p) for _, t, p in alts[:top]]}
            for _, text, lp, alts in tokens
        ]
        return {"content": content}
    offsets = []
    for _, text, _, _ in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": [text for _, text, _, _ in tokens],
        "token_logprobs": [lp for _, _, lp, _ in tokens],
        "top_logprobs": [
            None if lp is None else _top(text, lp, alts[:top]) for _, text, lp, alts in tokens
        ],
        "text_offset": offsets,
    }


def _top(text: str, logprob: float, alternatives: list[list]) -> dict[str, float]:
    """A legacy completion token's top_logprobs: the top N and the chosen token (N + 1 entries
    where it is not among them), as OpenAI and vLLM give them."""
    top = {t: p for _, t, p in alternatives}
    top.setdefault(text, logprob)
    return top


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
