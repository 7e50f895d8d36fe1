"""An event log as a Chrome trace (the JSON trace event format Perfetto and chrome://tracing open).

The time axis counts steps: step `s` is the slice [s, s + 1) ms, since a log records the order of
steps, not their wall time (which no replay could reproduce).  Process "engine": one slice per
step on the track "steps", named by its kind (the viewers colour slices by name; `cname` too),
with its batch in the args; transitions, phase changes, executor losses, recoveries and leak
reports as instants; memory as counters (live, reserved and arena MiB; KV pages used and cached;
host RSS MiB of each process).  Process "requests": each request as an async span from its
arrival to its finish, named by its client's id, with its phases nested in it (queued, prefill,
decode) and the steps it was not scheduled in between, named by the preemption recorded there
(preempted; requeued, by an executor loss) or waiting (out of budget).  `requests` keeps only
the named requests, `steps` a range of steps.
"""

from __future__ import annotations

import attrs

from memstep.events.types import (
    ExecutorLost,
    LeakSuspected,
    PhaseChanged,
    RecoveryDone,
    RequestAdded,
    RequestFinished,
    RequestNamed,
    RequestPreempted,
    RequestResumed,
    StateEntered,
    StepFinished,
    StepPlanned,
)

US_PER_STEP = 1000  # a step is one millisecond of the trace
ENGINE, REQUESTS = 1, 2
STEPS_TID = 1
MIB = 1 << 20
GAP_NAMES = {"preemption": "preempted", "recovery": "requeued"}
KIND_CNAME = {"no_spec": "thread_state_running", "spec": "thread_state_iowait"}


@attrs.define
class _Life:
    """What the trace draws of one request: the steps of its arrival, runs and finish."""

    name: str
    arrival: int
    ran: list[int] = attrs.Factory(list)
    first_token: int | None = None
    finish: int | None = None
    reason: str = ""
    evicted: dict[int, str] = attrs.Factory(dict)  # step: cause of a recorded preemption

    def gap_name(self, last_ran: int, runs_again: int) -> str:
        """A stretch out of the batch, named by the preemption recorded in it ("preempted",
        "requeued" by an executor loss), or "waiting" (no room in the step's budget)."""
        causes = [c for step, c in self.evicted.items() if last_ran <= step < runs_again]
        return GAP_NAMES[causes[0]] if causes else "waiting"


@attrs.frozen
class Window:
    """Steps [first, last] and which requests (None: all) go into the trace."""

    first: int = 0
    last: int = 1 << 62
    requests: frozenset[str] | None = None

    def has(self, step: int) -> bool:
        return self.first <= step <= self.last

    def clip(self, start_us: int, end_us: int) -> tuple[int, int] | None:
        lo, hi = max(start_us, self.first * US_PER_STEP), min(end_us, _us(self.last + 1))
        return (lo, hi) if lo < hi else None


def chrome_trace(records: list[object], window: Window = Window()) -> dict:
    """The trace of `records` within `window`, as the JSON object the viewers open."""
    events = _metadata()
    events += _engine(records, window)
    events += _requests(records, window)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _us(step: int) -> int:
    return step * US_PER_STEP


def _metadata() -> list[dict]:
    def meta(name: str, pid: int, tid: int, value: str) -> dict:
        return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": {"name": value}}

    return [
        meta("process_name", ENGINE, 0, "engine (1 ms = 1 step)"),
        meta("thread_name", ENGINE, STEPS_TID, "steps"),
        meta("process_name", REQUESTS, 0, "requests"),
    ]


def _engine(records: list[object], window: Window) -> list[dict]:
    events: list[dict] = []
    planned: StepPlanned | None = None
    for rec in records:
        step = getattr(rec, "step", None)
        if step is None or not window.has(step):
            continue
        if isinstance(rec, StepPlanned):
            planned = rec
        elif isinstance(rec, StepFinished) and planned is not None and planned.step == rec.step:
            events += _step(planned, rec)
        elif (instant := _instant(rec)) is not None:
            events.append(instant)
    return events


def _step(plan: StepPlanned, done: StepFinished) -> list[dict]:
    ts, m = _us(plan.step), done.memory
    args = {
        "step": plan.step,
        "batch_size": len(plan.batch),
        "num_tokens": plan.num_tokens,
        "num_sampled": sum(len(t) for _, t in done.sampled),
        "prefix_hits": len(plan.cached),
    }
    common = {"pid": ENGINE, "tid": STEPS_TID, "cat": "step"}
    cname = {"cname": KIND_CNAME[plan.kind]} if plan.kind in KIND_CNAME else {}
    return [
        {"ph": "B", "name": plan.kind, "ts": ts, **common, **cname, "args": args},
        {"ph": "E", "name": plan.kind, "ts": ts + US_PER_STEP, **common},
        _counter(
            "memory (MiB)",
            ts,
            live=m.live_bytes / MIB,
            reserved=m.reserved_bytes / MIB,
            arena=m.arena_claimed_bytes / MIB,
        ),
        _counter("KV pages", ts, used=m.kv_pages_used, cached=m.kv_pages_cached),
        _counter(
            "host RSS (MiB)", ts, executor=m.executor_rss_bytes / MIB, core=m.core_rss_bytes / MIB
        ),
    ]


def _counter(name: str, ts: int, **values: float) -> dict:
    return {"ph": "C", "name": name, "pid": ENGINE, "tid": 0, "ts": ts, "args": values}


def _instant(rec: object) -> dict | None:
    """A transition, phase change, loss, recovery or leak report, at the start of its step."""
    if isinstance(rec, StateEntered):
        name, args = f"enter {rec.kind}", {"bytes_claimed": rec.bytes_claimed}
    elif isinstance(rec, PhaseChanged):
        name, args = f"phase {rec.old} -> {rec.new}", {}
    elif isinstance(rec, ExecutorLost):
        name, args = "executor lost", {"reason": rec.reason, "during": rec.during}
    elif isinstance(rec, RecoveryDone):
        name, args = "recovered", {"seconds": rec.seconds, "readmitted": rec.num_readmitted}
    elif isinstance(rec, LeakSuspected):
        name, args = f"leak: {rec.what}", {"kind": rec.kind, "bytes": rec.nbytes}
    else:
        return None
    ts = _us(rec.step)  # type: ignore[attr-defined]
    return {
        "ph": "i",
        "s": "p",
        "name": name,
        "pid": ENGINE,
        "tid": STEPS_TID,
        "ts": ts,
        "cat": "transition",
        "args": args,
    }


def lives(records: list[object]) -> dict[str, _Life]:
    """Every request's arrival, steps run, first token and finish, by engine id."""
    out: dict[str, _Life] = {}
    for rec in records:
        if isinstance(rec, RequestAdded | RequestResumed):
            out[rec.request_id] = _Life(rec.request_id, rec.step)
        elif isinstance(rec, RequestNamed) and rec.request_id in out:
            out[rec.request_id].name = rec.client_id
        elif isinstance(rec, StepPlanned):
            for rid, _ in rec.batch:
                out[rid].ran.append(rec.step)
        elif isinstance(rec, StepFinished):
            for rid, tokens in rec.sampled:
                if tokens and out[rid].first_token is None:
                    out[rid].first_token = rec.step
        elif isinstance(rec, RequestPreempted):
            out[rec.request_id].evicted.setdefault(rec.step, rec.cause)
        elif isinstance(rec, RequestFinished) and rec.request_id in out:
            out[rec.request_id].finish, out[rec.request_id].reason = rec.step, rec.reason
    return out


def _requests(records: list[object], window: Window) -> list[dict]:
    last = max((r.step for r in records if isinstance(r, StepFinished)), default=0)
    events: list[dict] = []
    for engine_id, life in lives(records).items():
        if window.requests is None or window.requests & {engine_id, life.name}:
            events += _request(engine_id, life, last, window)
    return events


def _request(engine_id: str, life: _Life, last: int, window: Window) -> list[dict]:
    """The request's span and its phases, clipped to the window; nothing outside it."""
    end = _us((life.finish if life.finish is not None else last) + 1)
    # (depth, name, start, stop, args): the request, its phases, the gaps within them
    about: dict[str, object] = {"engine_id": engine_id, "finish": life.reason}
    spans: list[tuple[int, str, int, int, dict]] = [(0, life.name, _us(life.arrival), end, about)]
    if life.ran:
        token_end = _us(life.first_token + 1) if life.first_token is not None else end
        spans.append((1, "queued", _us(life.arrival), _us(life.ran[0]), {}))
        spans.append((1, "prefill", _us(life.ran[0]), token_end, {}))
        spans.append((1, "decode", token_end, end, {}))
    spans += [
        (2, life.gap_name(a, b), _us(a + 1), _us(b), {"last_ran": a})
        for a, b in zip(life.ran, life.ran[1:], strict=False)
        if b > a + 1
    ]
    marks = []
    for depth, name, start, stop, args in spans:
        clipped = window.clip(start, stop)
        if clipped is not None:
            common = {"cat": "request", "id": engine_id, "pid": REQUESTS, "tid": 0, "name": name}
            marks.append(
                ((clipped[0], 1, depth), {"ph": "b", "ts": clipped[0], **common, "args": args})
            )
            marks.append(((clipped[1], 0, -depth), {"ph": "e", "ts": clipped[1], **common}))
    # nested in time and in the file: at one instant ends (inner first) before begins (outer first)
    return [event for _, event in sorted(marks, key=lambda m: m[0])]
