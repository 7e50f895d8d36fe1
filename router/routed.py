"""A request the router is answering: where it runs and everything its client was sent."""

from __future__ import annotations

import attrs

from memstep.events.wire import GenerateDone, GenerateRequest, Timing, Usage


@attrs.define
class Routed:
    """One client request; the router's copy of its stream survives the replica it runs on."""

    envelope: list[bytes]  # the client's routing frames
    msg: GenerateRequest  # as the client sent it, with the seed the router made sure of
    seq: int  # the decision that routed it
    replica: int
    backend_id: str
    arrival: float  # time.monotonic()
    hashes: list[int]
    prompt_estimate: int  # tokens, for the load: exact for token ids, chars / 4 for text
    max_tokens: int
    token_ids: list[int] = attrs.Factory(list)
    texts: list[str] = attrs.Factory(list)
    logprobs: list[list] = attrs.Factory(list)
    token_times: list[float] = attrs.Factory(list)
    num_migrations: int = 0
    lost_at: float | None = None  # when its replica was lost, until its next token
    pause_s: float = 0.0

    @property
    def key(self) -> tuple[bytes, str]:
        return self.envelope[0], self.msg.request_id

    @property
    def load(self) -> int:
        return self.prompt_estimate + len(self.token_ids)

    def take(self, token_ids: list[int], text: str, logprobs: list[list], now: float) -> None:
        if self.lost_at is not None and token_ids:
            self.pause_s += now - self.lost_at
            self.lost_at = None
        self.token_ids.extend(token_ids)
        self.texts.append(text)
        self.logprobs.extend(logprobs)
        self.token_times.extend([now - self.arrival] * len(token_ids))

    def done(self, reason: str, now: float, last: GenerateDone | None = None) -> GenerateDone:
        """The client's GenerateDone: every token it was sent, by whichever replica."""
        prompt_tokens = last.usage.prompt_tokens if last is not None else self.prompt_estimate
        cached = last.usage.cached_tokens if last is not None else 0
        usage = Usage(prompt_tokens, len(self.token_ids), cached)
        ttft = self.token_times[0] if self.token_times else None
        queue_s = last.timing.queue_s if last is not None and not self.num_migrations else None
        timing = Timing(ttft, list(self.token_times), now - self.arrival, queue_s)
        text = "".join(self.texts)
        rid = self.msg.request_id
        return GenerateDone(rid, text, list(self.token_ids), reason, usage, timing, self.logprobs)
