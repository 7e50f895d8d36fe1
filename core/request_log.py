"""A request's life as log lines, written by the engine as it plans and records steps.

Every line carries the request's ids (`request_id`: its client's, `engine_id`: the engine's) and
the step number, so that one request's lines, picked out of a JSON log by either id, read in
order: queued, admitted (with its prefix-cache hit), prompt chunks (debug), first token,
preempted and resumed, requeued by a recovery and re-admitted (a preemption's and a requeue's
line from its RequestPreempted record).  The server adds `request arrived`, `request rejected`
and `request finished` (with its latencies); the HTTP front its own arrival line with the HTTP
ids.  At info level a request costs a few lines; the per-step and per-chunk lines are debug.
"""

from __future__ import annotations

import logging

import structlog

from memstep.core.request import Request
from memstep.core.scheduler import Scheduled, StepBatch
from memstep.events.types import MemoryReport, RequestPreempted

log = structlog.get_logger("memstep.request")

# the line of an admission's first plan, by why the request was waiting
ADMISSION = {None: "request admitted", "preemption": "request resumed"}
READMITTED = "request re-admitted"
EVICTED = {"preemption": "request preempted", "recovery": "request requeued"}


def queued(step: int, req: Request, num_waiting: int) -> None:
    p = req.params
    log.info(
        "request queued",
        step=step,
        **req.log_ids,
        prompt_tokens=req.num_prompt_tokens,
        max_tokens=p.max_tokens,
        num_waiting=num_waiting,
    )


def planned(step: int, kind: str, s: Scheduled) -> None:
    """The lines of a planned sequence that starts an admission or feeds a prompt chunk (debug);
    the engine calls it for those only (a decode has none)."""
    req = s.request
    start = req.num_computed
    if start == req.admitted_at:
        event = ADMISSION.get(req.evicted_by, READMITTED)
        log.info(event, step=step, **req.log_ids, prefix_hit_tokens=start, kind=kind)
    if start < req.num_prompt_tokens:
        log.debug(
            "prompt chunk",
            step=step,
            **req.log_ids,
            start=start,
            num_tokens=s.num_tokens,
            prompt_tokens=req.num_prompt_tokens,
        )


def first_token(step: int, req: Request) -> None:
    log.info("first token", step=step, **req.log_ids)


def evicted(rec: RequestPreempted, req: Request, why: str) -> None:
    """The line of a recorded preemption or requeue (an executor loss, `why`): the record's
    words, so the log lines and the tools that read the event log tell one story."""
    reason = {"why": why} if why else {}
    log.info(EVICTED[rec.cause], step=rec.step, **req.log_ids, tokens=rec.num_tokens, **reason)


def step_done(step: int, batch: StepBatch, memory: MemoryReport) -> None:
    """One debug line per step: its kind, batch and memory (its figures added up only when
    the line is written)."""
    if not log.is_enabled_for(logging.DEBUG):
        return
    log.debug(
        "step",
        step=step,
        kind=batch.kind,
        batch_size=len(batch.seqs),
        num_tokens=batch.num_tokens,
        live_bytes=memory.live_bytes,
        kv_pages_used=memory.kv_pages_used,
    )
