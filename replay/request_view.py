"""One request's life read back from an event log, and the slowest requests of a log.

`request_life` follows a request (by its engine id or the id its client gave it) through every
step that planned it: the step's kind and batch, the tokens fed and sampled, memory after the
step; its admissions, with what they reused through the prefix cache and which other requests
reused the same pages; its preemptions and requeues (recorded) and the recomputations after
them; its finish and, for a served log, the latencies the server measured.  `slowest` ranks a
log's requests by TTFT, TPOT and queue time (seconds where the server measured them, steps
otherwise).
"""

from __future__ import annotations

import re
from collections import defaultdict

import attrs

from memstep.core.sampling_params import SamplingParams
from memstep.events.types import (
    ExecutorLost,
    RequestAborted,
    RequestAdded,
    RequestFinished,
    RequestNamed,
    RequestPreempted,
    RequestResumed,
    RequestTimed,
    StepFinished,
    StepPlanned,
)


@attrs.define
class StepRow:
    """A step that fed the request: its kind, batch, and memory after it."""

    step: int
    kind: str
    batch_size: int
    step_tokens: int  # fed by the whole step
    fed: int  # fed for this request
    sampled: list[int] = attrs.Factory(list)
    live_bytes: int = 0
    kv_pages_used: int = 0
    note: str = ""  # "admitted", "resumed", "re-admitted", "finished: length", ...


@attrs.define
class RequestLife:
    engine_id: str
    client_ids: list[str]
    arrival_step: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = attrs.Factory(list)
    rows: list[StepRow] = attrs.Factory(list)
    # (step, what, detail): what is named as the server's log lines name it, less "request "
    events: list[tuple[int, str, str]] = attrs.Factory(list)
    hits: list[tuple[int, int, list[int]]] = attrs.Factory(list)  # (step, tokens, pages)
    shared_with: list[str] = attrs.Factory(list)  # requests that reused the same cached pages
    finish: tuple[int, str] | None = None  # (step, reason)
    timed: RequestTimed | None = None

    @property
    def first_token_step(self) -> int | None:
        return next((r.step for r in self.rows if r.sampled), None)


class UnknownRequestId(LookupError):
    pass


def find_engine_id(records: list[object], request_id: str) -> str:
    """The engine id of the request its engine or its client calls `request_id`."""
    added = {r.request_id for r in records if isinstance(r, RequestAdded | RequestResumed)}
    if request_id in added:
        return request_id
    for r in records:
        if isinstance(r, RequestNamed) and _names(r.client_id, request_id):
            return r.request_id
    raise UnknownRequestId(f"no request {request_id!r} in this log (give an engine or client id)")


def _names(client_id: str, given: str) -> bool:
    """Whether `given` is the client's id, or for the HTTP front's `cmpl-X.TAG-0` (a choice of
    the HTTP request `cmpl-X`, named `X` by its `X-Request-Id`, tagged in the core) its HTTP id,
    X, or either tagged."""
    tagged = client_id.rsplit("-", 1)[0]
    http_id = _TAG.sub("", tagged)
    return given in (client_id, tagged, http_id) or http_id.split("-", 1)[-1] == given


_TAG = re.compile(r"\.[0-9a-f]{8}$")  # the HTTP front's tag of a named request (`_core_id`)


def request_life(
    records: list[object], request_id: str, records_preemptions: bool = True
) -> RequestLife:
    """`records_preemptions`: False for a log of format 1 (no RequestPreempted records)."""
    engine_id = find_engine_id(records, request_id)
    life: RequestLife | None = None
    tracker = _Tracker(records_preemptions)
    for rec in records:
        if life is None:
            if isinstance(rec, RequestAdded | RequestResumed) and rec.request_id == engine_id:
                life = _born(rec)
            continue
        tracker.see(life, rec)
    assert life is not None
    life.shared_with = _sharers(records, life)
    return life


def _born(rec: RequestAdded | RequestResumed) -> RequestLife:
    outputs = list(rec.output_token_ids) if isinstance(rec, RequestResumed) else []
    life = RequestLife(rec.request_id, [], rec.step, list(rec.prompt_token_ids), rec.params)
    life.output_token_ids = outputs
    detail = f"{len(rec.prompt_token_ids)} prompt tokens"
    if outputs:
        detail += f", {len(outputs)} tokens from an earlier server's log"
    life.events.append((rec.step, "arrived", detail))
    return life


# a re-admission's note and why, by the cause of the preemption recorded before it (None: a log
# of format 1, which records no preemption: only the recomputation shows)
READMISSION = {
    "preemption": ("resumed", "after a preemption"),
    "recovery": ("re-admitted", "after the recovery"),
    None: ("recomputed", "its KV was freed (this log's format records no preemption)"),
}


@attrs.define
class _Tracker:
    """Follows the request's recorded preemptions and requeues to tell an admission from a
    recomputation (in a log of format 1, its computed tokens)."""

    recorded: bool  # the log records preemptions (RequestPreempted, format 2 on)
    computed: int = 0
    last_step: int | None = None
    evicted: str | None = None  # the cause of its last preemption, until it runs again
    loss: str = ""  # the reason of the last executor loss
    done: bool = False

    def see(self, life: RequestLife, rec: object) -> None:
        if self.done:  # its last step's record and the server's timings follow its finish
            if isinstance(rec, RequestTimed) and rec.request_id == life.engine_id:
                life.timed = rec
            elif isinstance(rec, StepFinished):
                self._finished(life, rec)
            return
        if isinstance(rec, RequestNamed) and rec.request_id == life.engine_id:
            life.client_ids.append(rec.client_id)
        elif isinstance(rec, StepPlanned):
            self._planned(life, rec)
        elif isinstance(rec, StepFinished):
            self._finished(life, rec)
        elif isinstance(rec, ExecutorLost):
            self._lost(life, rec)
        elif isinstance(rec, RequestPreempted) and rec.request_id == life.engine_id:
            self._evicted(life, rec)
        elif isinstance(rec, RequestAborted) and rec.request_id == life.engine_id:
            life.events.append((rec.step, "aborted", "by its client"))
        elif isinstance(rec, RequestFinished) and rec.request_id == life.engine_id:
            life.finish = (rec.step, rec.reason)
            life.events.append((rec.step, "finished", rec.reason))
            self.done = True

    def _lost(self, life: RequestLife, rec: ExecutorLost) -> None:
        if life.rows and life.rows[-1].step == rec.step:
            life.rows[-1].note = "executor lost: never ran"
        self.loss = rec.reason

    def _evicted(self, life: RequestLife, rec: RequestPreempted) -> None:
        self.evicted = rec.cause
        if rec.cause == "recovery":
            life.events.append((rec.step, "requeued", f"executor lost: {self.loss}"))
        else:
            life.events.append((rec.step, "preempted", f"{rec.num_tokens} tokens to recompute"))

    def _is_readmitted(self, life: RequestLife, fed: int, hit: list | None) -> bool:
        if self.recorded:
            return self.evicted is not None
        total = len(life.prompt_token_ids) + len(life.output_token_ids)
        return hit is not None or self.computed + fed > total

    def _planned(self, life: RequestLife, rec: StepPlanned) -> None:
        fed = next((n for rid, n in rec.batch if rid == life.engine_id), None)
        if fed is None:
            return
        hit = next((c for c in rec.cached if c[0] == life.engine_id), None)
        note = ""
        if self.last_step is None:
            note, self.computed = "admitted", hit[1] if hit else 0
        elif self._is_readmitted(life, fed, hit):
            note, why = READMISSION[self.evicted]
            detail = f"{why}: recomputes its KV (last ran at step {self.last_step})"
            life.events.append((rec.step, note, detail))
            self.computed = hit[1] if hit else 0
        if hit is not None:
            life.hits.append((rec.step, hit[1], list(hit[2])))
        if note == "admitted":
            life.events.append((rec.step, note, f"prefix hit {hit[1] if hit else 0} tokens"))
        self.computed += fed
        self.last_step, self.evicted = rec.step, None
        row = StepRow(rec.step, rec.kind, len(rec.batch), rec.num_tokens, fed, note=note)
        life.rows.append(row)

    def _finished(self, life: RequestLife, rec: StepFinished) -> None:
        row = life.rows[-1] if life.rows and life.rows[-1].step == rec.step else None
        if row is None:
            return
        row.live_bytes, row.kv_pages_used = rec.memory.live_bytes, rec.memory.kv_pages_used
        for rid, tokens in rec.sampled:
            if rid == life.engine_id:
                if not life.output_token_ids and tokens:
                    life.events.append((rec.step, "first token", ""))
                row.sampled = list(tokens)
                life.output_token_ids += tokens
                self.computed += len(tokens) - 1


def _sharers(records: list[object], life: RequestLife) -> list[str]:
    pages = {p for _, _, used in life.hits for p in used}
    others = {
        rid
        for r in records
        if isinstance(r, StepPlanned)
        for rid, _, used in r.cached
        if rid != life.engine_id and pages.intersection(used)
    }
    return sorted(others, key=_id_order)


def _id_order(request_id: str) -> tuple[int, str]:
    tail = request_id.rsplit("-", 1)[-1]
    return (int(tail), request_id) if tail.isdigit() else (1 << 62, request_id)


# --- the slowest requests ----------------------------------------------------------------------


@attrs.frozen
class RequestTimes:
    engine_id: str
    client_id: str
    ttft: float | None
    tpot: float | None
    queue: float | None
    completion_tokens: int
    unit: str  # "s" (measured by the server) or "steps" (an offline log)


def request_times(records: list[object]) -> list[RequestTimes]:
    """Every finished request's TTFT, TPOT and queue time."""
    names = {r.request_id: r.client_id for r in records if isinstance(r, RequestNamed)}
    timed = {r.request_id: r for r in records if isinstance(r, RequestTimed)}
    added = {r.request_id: r.step for r in records if isinstance(r, RequestAdded)}
    first, planned = _first_steps(records)
    out = []
    for r in records:
        if not isinstance(r, RequestFinished):
            continue
        rid, n = r.request_id, r.completion_tokens
        t = timed.get(rid)
        if t is not None:
            tpot = (t.e2e_s - t.ttft_s) / (n - 1) if t.ttft_s is not None and n > 1 else None
            times = (t.ttft_s, tpot, t.queue_s, "s")
        else:
            start, got = added.get(rid, 0), first.get(rid)
            ttft = got - start + 1 if got is not None else None
            tpot = (r.step - got) / (n - 1) if got is not None and n > 1 else None
            queue = planned[rid] - start if rid in planned else None
            times = (ttft, tpot, queue, "steps")
        out.append(RequestTimes(rid, names.get(rid, rid), *times[:3], n, times[3]))
    return out


def _first_steps(records: list[object]) -> tuple[dict[str, int], dict[str, int]]:
    first: dict[str, int] = {}
    planned: dict[str, int] = {}
    for r in records:
        if isinstance(r, StepFinished):
            for rid, tokens in r.sampled:
                if tokens:
                    first.setdefault(rid, r.step)
        elif isinstance(r, StepPlanned):
            for rid, _ in r.batch:
                planned.setdefault(rid, r.step)
    return first, planned


def slowest(records: list[object], top: int = 10) -> dict[str, list[RequestTimes]]:
    """The `top` requests by TTFT, by TPOT and by queue time, slowest first."""
    times = request_times(records)
    ranked: dict[str, list[RequestTimes]] = defaultdict(list)
    for field in ("ttft", "tpot", "queue"):
        known = [t for t in times if getattr(t, field) is not None]
        ranked[field] = sorted(known, key=lambda t: -getattr(t, field))[:top]
    return dict(ranked)
