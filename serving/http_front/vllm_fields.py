"""vLLM's request fields that the OpenAI front takes only at the value that changes nothing here.

vLLM's OpenAI server accepts more fields than OpenAI's; a client written for it (lm-eval, guidellm,
LangChain's vLLM wrappers) may send any of them, often at its default.  Each one is either served
(`serving/http_front/openai_protocol.py`), or listed here: taken at the value listed (the one that
asks for nothing the engine does not do anyway), and refused by name, with the reason, at any other
value.  None (JSON null) is always taken: it means "the default".
"""

from __future__ import annotations

from typing import Any

# field -> (the values taken, why another is refused)
BOTH: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1, 1.0), "length_penalty applies to beam search, which is not supported"),
    "spaces_between_special_tokens": (
        (True, False),
        "special tokens give no text here, so spacing between them changes nothing",
    ),
    "truncate_prompt_tokens": ((), "prompts are not truncated: a prompt too long is refused"),
    "allowed_token_ids": (([],), "allowed_token_ids is not supported (use logit_bias)"),
    "bad_words": (([],), "bad_words is not supported (use logit_bias)"),
    "priority": ((0,), "requests are scheduled first come, first served (no priorities)"),
    "logits_processors": (([],), "no code from a request runs here"),
    "return_tokens_as_token_ids": ((False,), "tokens are returned as text"),
    "return_token_ids": ((False,), "token ids are not returned over HTTP (the ZMQ API has them)"),
    "cache_salt": ((), "the prefix cache is shared by all requests (no per-request salt)"),
    "kv_transfer_params": ((), "KV transfer between servers is not supported"),
    "vllm_xargs": ((), "vllm_xargs is vLLM's own extension point"),
    "guided_decoding_backend": ((), "the structured-output backend is llguidance, always"),
    "guided_whitespace_pattern": ((), "guided_whitespace_pattern is not supported"),
    "structural_tag": ((), "structural_tag is not supported"),
    "request_id": ((), "give the request's id in the X-Request-Id header"),
}
COMPLETION_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "prompt_embeds": ((), "prompt embeddings are not supported"),
}
CHAT_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "add_generation_prompt": ((True,), "a chat is always read with the generation prompt"),
    "continue_final_message": ((False,), "a chat's final message is not continued"),
    "include_reasoning": ((True,), "no reasoning parser runs: reasoning stays in the content"),
    "documents": ((), "documents are not passed to the chat template"),
    "chat_template": ((), "the server's chat template is used (memstep serve --chat-template)"),
    "mm_processor_kwargs": ((), "only text is served"),
    "media_io_kwargs": ((), "only text is served"),
    "echo": ((False,), "a chat reply is not prefixed with the last message"),
}
COMPLETION_FIELDS = BOTH | COMPLETION_ONLY
CHAT_FIELDS = BOTH | CHAT_ONLY


def refusal(
    body: dict[str, Any], fields: dict[str, tuple[tuple[Any, ...], str]]
) -> tuple[str, str] | None:
    """The first of `fields` that `body` sets to a value not taken: (its name, why)."""
    for name, (taken, why) in fields.items():
        value = body.get(name)
        if value is None or any(_same(value, t) for t in taken):
            continue
        return name, f"{name} {value!r} is not supported: {why}"
    return None


def _same(value: Any, taken: Any) -> bool:
    return value == taken and isinstance(value, bool) == isinstance(taken, bool)
