"""What the engine hands back to its callers after each step."""

from __future__ import annotations

import attrs


@attrs.define
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (set when finished)
    logprobs: list[list] = attrs.Factory(list)  # per new token: [logprob, [[id, logprob], ...]]
    num_proposed: int = 0  # speculative drafts proposed for this request so far
    num_accepted: int = 0
    # SamplingParams.prompt_logprobs: prompt positions 1.. as [logprob, [[id, logprob], ...],
    # rank], on the first output that carries a token
    prompt_logprobs: list[list] = attrs.Factory(list)
    error: str = ""  # finish_reason "error": why the request could not go on


@attrs.define
class Completion:
    """A finished request, as `Engine.generate` returns it."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    logprobs: list[list] = attrs.Factory(list)
    num_proposed: int = 0
    num_accepted: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    prompt_logprobs: list[list] = attrs.Factory(list)  # prompt positions 1.. (RequestOutput's)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0
