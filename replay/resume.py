"""What a dead server's event log says about its requests, for `memstep serve --resume LOG`.

The log holds every request's prompt, sampling parameters (with the seed the engine drew) and
every token sampled for it, so a new engine can re-admit the unfinished ones with the tokens they
had and sample on from there: sampling is keyed by (seed, position), so each goes on as it would
have without the crash.  The log also holds the id each client gave its request (`RequestNamed`),
which is how a reconnecting client finds its stream again.

A SIGKILL can leave the last frame half-written; the reader keeps everything before it.  A
request whose `RequestFinished` survived but not all of whose tokens did is re-admitted too: its
lost tokens are recomputed, and it finishes again where it did.
"""

from __future__ import annotations

from typing import Any

import attrs

from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import (
    RequestAborted,
    RequestAdded,
    RequestFinished,
    RequestNamed,
    RequestResumed,
    StepFinished,
)
from memstep.replay.recording import Recording


@attrs.define
class Carried:
    """One request of the earlier log, as far as that log goes."""

    request_id: str  # the earlier engine's id, kept by the new engine
    prompt_token_ids: list[int]
    params: SamplingParams  # with its seed
    output_token_ids: list[int]
    arrival_time: float
    client_id: str | None = None  # None: no client named it (an in-process engine's request)
    finish_reason: str | None = None  # None: unfinished, to be re-admitted

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@attrs.frozen
class ResumePoint:
    """The requests of a dead server's log, in arrival order, and how the new log links to it."""

    recording: Recording
    requests: list[Carried]

    @property
    def unfinished(self) -> list[Carried]:
        return [r for r in self.requests if not r.is_finished]

    def config(self, fault_injector: EngineConfig) -> EngineConfig:
        """The earlier engine's config with a seed drawn afresh (new requests must not repeat
        the earlier ones' seeds) and the test-only fault injector of `fault_injector`."""
        cfg = EngineConfig.from_dict(self.recording.config)
        return cfg.replace(
            seed=None,
            debug_kill_executor_at=fault_injector.debug_kill_executor_at,
            debug_kill_restarted_executor=fault_injector.debug_kill_restarted_executor,
        )

    def link(self) -> dict[str, Any]:
        """The new log's header entry `resumed_from`: which log, up to which step."""
        rec = self.recording
        return {
            "path": str(rec.path.resolve()),
            "created": rec.header.get("created"),
            "last_step": rec.last_step,
            "damaged": rec.describe_problem() or "",
            "num_unfinished": len(self.unfinished),
        }


def resume_point(recording: Recording) -> ResumePoint:
    """Every request of `recording` with its tokens, finish and client id, in arrival order.

    A recording with a corrupt stretch mid-log is cut there, since a lost record may have been
    a request's input or tokens."""
    recording = recording.before_damage()
    carried: dict[str, Carried] = {}
    finished: dict[str, RequestFinished] = {}
    for rec in recording.records:
        if isinstance(rec, RequestFinished):
            finished[rec.request_id] = rec  # its step's tokens come after it, in StepFinished
        else:
            _take(carried, rec)
    for request_id, done in finished.items():
        req = carried.get(request_id)
        if req is not None and done.completion_tokens <= len(req.output_token_ids):
            req.finish_reason = done.reason  # else its last tokens were lost with the tail
    return ResumePoint(recording, list(carried.values()))


def _take(carried: dict[str, Carried], rec: object) -> None:
    if isinstance(rec, RequestAdded | RequestResumed):
        out = list(getattr(rec, "output_token_ids", []))
        ids = list(rec.prompt_token_ids)
        carried[rec.request_id] = Carried(rec.request_id, ids, rec.params, out, rec.arrival_time)
    elif isinstance(rec, RequestNamed) and rec.request_id in carried:
        carried[rec.request_id].client_id = rec.client_id
    elif isinstance(rec, StepFinished):
        for request_id, tokens in rec.sampled:
            if request_id in carried:
                carried[request_id].output_token_ids.extend(tokens)
    elif isinstance(rec, RequestAborted) and rec.request_id in carried:
        carried[rec.request_id].finish_reason = "abort"  # aborted while recovering
