"""Logprobs of a request's prompt tokens (SamplingParams.prompt_logprobs), from the hidden states
of its prefill chunks: the state after position p scores the prompt token at p + 1.

A chunk's last state scores the next chunk's first token, which the executor learns only from
that chunk's plan: the state (one hidden row in the model's dtype on the device, per request
between two of its chunks: 576 values against a vocabulary of 49,152 float32 logits for
SmolLM2, 4,096 against 128,256 for Llama 3 8B) is held until then, and dropped when the request
is forgotten or admitted again (a chunk from position 0 finds it scoring another position and
drops it).  The rows are planned like the sampler's buffers (`rows_nbytes`, in the memory plan):
one persistent row per running request, made with the scorer, so that holding one allocates
nothing while serving (a lazily made row read as live growth to the leak detector).  A row
outliving its request (a broken `forget`) takes a slot for good; with none left a held state is
a tensor of its own, which the leak detector then sees grow.

The prompt's last state scores the first output token, not a prompt token: the
sampler's `logprobs` cover it. Rows go through the head `SLICE` at a time, so a long chunk never
holds a whole chunk of logits at once. Each token's rank in its row (1 + the tokens the model
gives a higher logprob; vLLM's `Logprob.rank`) comes with its score.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from memstep.events.plan import PromptLogprobs, SeqPlan
from memstep.executors.model.llama import LlamaModel
from memstep.executors.runtime.running_requests import RunningRequests
from memstep.executors.runtime.sampler import top_logprobs
from memstep.states.lifecycle import held_by

SLICE = 256  # states through the head at once


class PromptScorer:
    def __init__(
        self, model: LlamaModel, requests: RunningRequests, max_rows: int, dtype: torch.dtype
    ):
        self.model, self.requests = model, requests
        width, device = model.cfg.hidden_size, model.w["embed"].device
        self._rows = torch.zeros(max_rows, width, dtype=dtype, device=device)  # [rows, hidden]
        self._free = list(range(max_rows - 1, -1, -1))
        self._slots: dict[str, int] = {}  # id -> its row of `_rows`
        self._held: dict[str, tuple[int, torch.Tensor]] = {}  # id -> (position scored, state)
        self._scored: list[PromptLogprobs] = []

    def wanted(self, feeds: Sequence[tuple[SeqPlan, list[int]]]) -> bool:
        """Whether any feed is a prompt chunk of a request that asked for prompt logprobs (at
        once, where no running request asked)."""
        return bool(self.requests.scoring) and any(self._asks(seq) is not None for seq, _ in feeds)

    def _asks(self, seq: SeqPlan) -> int | None:
        if seq.start_pos >= seq.prompt_len or seq.request_id not in self.requests.scoring:
            return None
        return self.requests[seq.request_id].params.prompt_logprobs

    def score(
        self,
        feeds: Sequence[tuple[SeqPlan, list[int]]],
        hidden: torch.Tensor,
        last_rows: list[int],
    ) -> None:
        """Score the prompt tokens of this forward's chunks (`hidden`: every fed token's state)."""
        for (seq, tokens), last in zip(feeds, last_rows, strict=True):
            n = self._asks(seq)
            if n is None:
                continue
            held = self._held.get(seq.request_id)
            fed = min(len(seq.token_ids), seq.prompt_len - seq.start_pos)
            first = last - len(tokens) + 1
            # state i of this chunk scores prompt token start_pos + i + 1; the prompt's last
            # state scores the first output token, so it is left out
            ends_prompt = seq.start_pos + fed == seq.prompt_len
            entries: list[list] = []
            start = seq.start_pos + 1
            if held is not None and held[0] == seq.start_pos:
                entries += _ranked(self.model.logits(held[1]), seq.token_ids[:1], n)
                start = seq.start_pos
            targets = seq.token_ids[1:fed]
            for lo in range(0, len(targets), SLICE):
                states = hidden[first + lo : first + min(lo + SLICE, len(targets))]
                entries += _ranked(self.model.logits(states), targets[lo : lo + SLICE], n)
            self.forget(seq.request_id)  # its row is scored: free for the state kept next
            if not ends_prompt:  # the step's buffer moves on: the state is copied to a row
                state = self._row(seq.request_id).copy_(hidden[first + fed - 1 : first + fed])
                self._held[seq.request_id] = (seq.start_pos + fed, state)
            if entries:
                self._scored.append(PromptLogprobs(seq.request_id, start, entries))

    def holdings(self) -> dict[str, tuple[int, int, str]]:
        """The rows held between chunks, as the step kinds' holdings name what they keep (a
        leak report's `grew:`)."""
        return held_by("prompt_scorer.held", self._held)

    def take(self) -> list[PromptLogprobs]:
        """What this step scored, for its result."""
        scored, self._scored = self._scored, []
        return scored

    def _row(self, request_id: str) -> torch.Tensor:
        """A planned row for `request_id`'s state ([1, hidden]); a new tensor if none is free."""
        if not self._free:
            return torch.empty_like(self._rows[:1])
        self._slots[request_id] = slot = self._free.pop()
        return self._rows[slot : slot + 1]

    def forget(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        for request_id in list(self._held):
            self.forget(request_id)
        self._scored.clear()


def rows_nbytes(max_rows: int, hidden_size: int, dtype: torch.dtype) -> int:
    """The bytes of a `PromptScorer`'s rows, for the memory plan."""
    return max_rows * hidden_size * dtype.itemsize


def _ranked(logits: torch.Tensor, tokens: list[int], n: int) -> list[list]:
    """[logprob, [[id, logprob] x n], rank] of each row's token (`logits`, float32, become
    their log-softmax): its rank is 1 + the number of tokens scored above it."""
    entries = top_logprobs(logits, tokens, n, in_place=True)
    index = torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None]
    ranks = (logits > logits.gather(1, index)).sum(dim=1) + 1
    return [[*entry, rank] for entry, rank in zip(entries, ranks.tolist(), strict=True)]
