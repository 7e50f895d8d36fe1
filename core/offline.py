"""Offline runs: step an engine until its requests are done and put each one's outputs
together as a `Completion` (`Engine.generate`, `Engine.run_until_idle`)."""

from __future__ import annotations

from collections.abc import Callable

from memstep.core.outputs import Completion, RequestOutput


def run_until_idle(
    has_work: Callable[[], bool], step: Callable[[], list[RequestOutput]]
) -> dict[str, Completion]:
    """`step()` while `has_work()`; each finished request's completion by its id."""
    tokens: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    logprobs: dict[str, list] = {}
    prompt_logprobs: dict[str, list] = {}
    done: dict[str, Completion] = {}
    while has_work():
        for out in step():
            if out.prompt_logprobs:
                prompt_logprobs[out.request_id] = out.prompt_logprobs
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
            logprobs.setdefault(out.request_id, []).extend(out.logprobs)
            if out.finished:
                ids = tokens.pop(out.request_id)
                done[out.request_id] = Completion(
                    out.request_id,
                    texts.pop(out.request_id),
                    ids,
                    out.finish_reason or "",
                    out.prompt_tokens,
                    logprobs.pop(out.request_id),
                    out.num_proposed,
                    out.num_accepted,
                    out.cached_tokens,
                    prompt_logprobs.pop(out.request_id, []),
                )
    return done
