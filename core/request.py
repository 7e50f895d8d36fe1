"""A request as the engine core tracks it: tokens so far, progress through the KV cache."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from memstep.core.detokenizer import output_text
from memstep.core.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        decode: Callable[[list[int]], str],
        token_bytes: Sequence[bytes] | None = None,  # each id's bytes, where ids are bytes
    ):
        self.request_id = request_id
        self.client_id = request_id  # the id its client gave (`Engine.name`), in its log lines
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, float]] = []
        # SamplingParams.prompt_logprobs: the scores of prompt positions 1.. as they come, and
        # whether an output has carried them yet (the first output that has a token does)
        self.prompt_logprobs: list[list] = []
        self.prompt_logprobs_sent = False
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.table_sent = (
            0  # entries of its block table the executor holds (SeqPlan.num_pages_held)
        )
        # where the latest admission started: its prefix hit (0 without one); the first plan of
        # an admission starts here, its Admission carrying the params and the cached prefix
        self.admitted_at = 0
        self.num_cached_tokens = 0  # prompt tokens reused from the prefix cache at first admission
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.evicted_by: str | None = None  # "preemption" or "recovery": why it last lost its KV
        self.num_proposed = 0
        self.num_accepted = 0
        # adaptive K (core/draft_length.py): drafts this request is given per spec step (None:
        # the config's K), and its decayed count of accepted drafts and of drafts judged
        self.draft_length: int | None = None
        self.draft_hits = self.draft_trials = 0.0
        # the output text, grown step by step
        self.detok = output_text(decode, token_bytes)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, start: int, stop: int) -> list[int]:
        prompt = self.prompt_token_ids
        if stop <= len(prompt):
            return prompt[start:stop]
        if start >= len(prompt):  # decoding: no copy of the whole sequence
            return self.output_token_ids[start - len(prompt) : stop - len(prompt)]
        return (prompt + self.output_token_ids)[start:stop]

    @property
    def scores_prompt(self) -> bool:
        """Its prompt tokens are still to be scored: their states must be computed, none taken
        from the prefix cache."""
        wanted = self.params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def add_prompt_logprobs(self, start: int, entries: list[list]) -> None:
        """Scores from position `start` on; those of positions already held (the prompt computed
        again after a preemption) are dropped."""
        have = 1 + len(self.prompt_logprobs)
        if start <= have < start + len(entries):
            self.prompt_logprobs.extend(entries[have - start :])

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to feed before the next sample (1 when decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.num_uncomputed == 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def admit(self, num_cached: int) -> None:
        """Start running with `num_cached` tokens whose KV the prefix cache already holds."""
        self.status = Status.RUNNING
        self.num_computed = self.admitted_at = num_cached
        if not self.num_preemptions:
            self.num_cached_tokens = min(num_cached, self.num_prompt_tokens)

    @property
    def log_ids(self) -> dict[str, str]:
        """The ids of the request's log lines: its client's and the engine's."""
        return {"request_id": self.client_id, "engine_id": self.request_id}

    def preempt(self, cause: str = "preemption") -> None:
        self.num_computed = 0
        self.status = Status.WAITING
        self.num_preemptions += 1
        self.evicted_by = cause
