"""Following one request through a served run (`served_run`: ZMQ and HTTP, a prefix hit,
preemptions, an executor SIGKILL and its recovery): its JSON log lines, `inspect --request`,
`inspect --requests` and `trace`."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from replay_helpers import isolate_heap, memstep
from served_run import TWICE, X_REQUEST_ID

from memstep.events import log as events_log
from memstep.events.log import _RESERVED_KEYS, LogWriter
from memstep.events.types import (
    RequestFinished,
    RequestNamed,
    RequestPreempted,
    StepFinished,
)
from memstep.replay.compare import replayable_bytes
from memstep.replay.recording import load
from memstep.replay.replayer import replay
from memstep.replay.report import build_report

# a request's info lines, one letter each, in the only orders a life can take
CODES = {
    "request arrived": "A",
    "request queued": "Q",
    "request admitted": "D",
    "first token": "F",
    "request preempted": "P",
    "request resumed": "R",
    "request requeued": "L",
    "request re-admitted": "M",
    "request finished": "X",
}
LIFE = re.compile(
    r"A+QD(PR|LM|PLR)*F(PR|LM|PLR)*X"
)  # HTTP: the front's arrival line, then the core's


def life_of(lines: list[dict], request_id: str) -> list[dict]:
    """A request's lines, picked by its id as `jq 'select(.request_id == ID)'` picks them."""
    return [line for line in lines if line.get("request_id") == request_id]


def reads_in_order(life: list[dict]) -> bool:
    """Its info lines follow the grammar of a life, at steps that never go back."""
    word = "".join(CODES.get(line["event"], "") for line in life)
    steps = [line["step"] for line in life if "step" in line]
    return bool(LIFE.fullmatch(word)) and steps == sorted(steps)


def test_one_request_s_json_lines_give_its_whole_life_in_order(served_run):
    lines = served_run.lines
    preempted = {x["request_id"] for x in lines if x["event"] == "request preempted"}
    requeued = {x["request_id"] for x in lines if x["event"] == "request requeued"}
    assert preempted and requeued, "the run must preempt and recover"
    for rid in sorted(preempted | requeued | {"warm"}):
        life = life_of(lines, rid)
        assert reads_in_order(life), (rid, [x["event"] for x in life])
        assert len({x["engine_id"] for x in life if "engine_id" in x}) == 1
        done = life[-1]
        assert done["completion_tokens"] == (4 if rid == "warm" else 40)
        assert done["ttft_s"] > 0 and done["e2e_s"] >= done["ttft_s"] and done["queue_s"] >= 0
        assert done["tpot_s"] > 0 and done["finish_reason"] == "length"
    hits = [x for x in lines if x["event"] == "request admitted" and x["prefix_hit_tokens"] == 32]
    assert {x["request_id"] for x in hits} >= {f"zmq-{i}" for i in range(6)}
    chunks = [x for x in life_of(lines, "zmq-0") if x["event"] == "prompt chunk"]
    assert chunks and chunks[0]["start"] == 32 and chunks[0]["level"] == "debug"


def test_the_order_check_fails_on_a_life_out_of_order(served_run):
    """The check above can fail: the same lines shuffled, or missing their finish, do not read
    as a life."""
    (rid, *_) = sorted(
        {x["request_id"] for x in served_run.lines if x["event"] == "request requeued"}
    )
    life = life_of(served_run.lines, rid)
    shuffled = list(life)
    random.Random(0).shuffle(shuffled)
    assert reads_in_order(life)
    assert not reads_in_order(shuffled) and not reads_in_order(life[:-1])


def test_x_request_id_round_trips_and_names_the_request_in_the_logs(served_run):
    named = served_run.seen["http"]["named"]
    assert named.status_code == 200 and named.headers["x-request-id"] == X_REQUEST_ID
    assert named.json()["id"] == f"cmpl-{X_REQUEST_ID}"
    core_id = core_id_of(served_run.lines, X_REQUEST_ID)
    life = life_of(served_run.lines, core_id)
    assert life[0]["x_request_id"] == X_REQUEST_ID and life[0]["http_id"] == f"cmpl-{X_REQUEST_ID}"
    assert reads_in_order(life), [x["event"] for x in life]
    assert life[-1]["completion_tokens"] == 5


def core_id_of(lines: list[dict], x_request_id: str) -> str:
    """The core's id of the request the client named `x_request_id` (its one choice), as its
    arrival line gives it: the way to follow a named request through the core's lines."""
    (arrived,) = arrivals(lines, x_request_id)
    return arrived["request_id"]


def arrivals(lines: list[dict], x_request_id: str) -> list[dict]:
    named = [x for x in lines if x.get("x_request_id") == x_request_id]
    return [x for x in named if x["event"] == "request arrived"]


def test_two_requests_in_flight_with_one_x_request_id_are_both_served(served_run):
    """vLLM's way: the header is echoed and names the response, the core's ids stay unique."""
    whole, streamed = served_run.seen["http"]["twice"]
    assert [whole.status_code, streamed.status_code] == [200, 200], whole.text + streamed.text
    assert whole.headers["x-request-id"] == streamed.headers["x-request-id"] == TWICE
    assert whole.json()["id"] == f"cmpl-{TWICE}" and f'"id":"cmpl-{TWICE}"' in streamed.text
    assert whole.json()["usage"]["completion_tokens"] == 12 and streamed.text.endswith("[DONE]\n\n")
    core_ids = [x["request_id"] for x in arrivals(served_run.lines, TWICE)]
    assert len(set(core_ids)) == 2 and all(i.startswith(f"cmpl-{TWICE}.") for i in core_ids)
    finished = [x for x in served_run.lines if x["event"] == "request finished"]
    assert sorted(x["request_id"] for x in finished if x["request_id"] in core_ids) == sorted(
        core_ids
    )


def test_rejected_requests_are_logged_with_their_reason(served_run):
    assert served_run.seen["rejected"] == "invalid_request"
    (core,) = [x for x in served_run.lines if x["event"] == "request rejected" and "code" in x]
    assert core["request_id"] == "empty" and core["reason"] == "prompt is empty"
    bad = served_run.seen["http"]["bad"]
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-1"
    front = [x for x in served_run.lines if x.get("x_request_id") == "bad-1"]
    assert [x["event"] for x in front] == ["request rejected"] and front[0]["status"] == 400
    assert "not valid JSON" in front[0]["reason"]
    spaced = served_run.seen["http"]["spaced"]
    assert spaced.status_code == 400 and "X-Request-Id" in spaced.json()["error"]["message"]


# --- inspect ----------------------------------------------------------------------------------

VIEW_OF_LINE = {
    "request admitted": "admitted",
    "request preempted": "preempted",
    "first token": "first token",
    "request resumed": "resumed",
    "request requeued": "requeued",
    "request re-admitted": "re-admitted",
}


def evicted_ids(lines: list[dict]) -> list[str]:
    """The requests the run preempted or requeued, by their log lines."""
    evicted = ("request preempted", "request requeued")
    return sorted({x["request_id"] for x in lines if x["event"] in evicted})


def life_shown(log: Path, rid: str) -> tuple[dict, list[tuple[int, str]]]:
    """`inspect --request` of `rid`: its view, and its events as the log lines name them."""
    code, out, err = memstep("inspect", str(log), "--request", rid, "--json")
    assert code == 0, err
    view = json.loads(out)
    return view, [(step, what) for step, what, _ in view["events"] if what in LINE_OF_VIEW]


LINE_OF_VIEW = set(VIEW_OF_LINE.values())


def life_logged(lines: list[dict], rid: str) -> list[tuple[int, str]]:
    return [
        (x["step"], VIEW_OF_LINE[x["event"]])
        for x in life_of(lines, rid)
        if x["event"] in VIEW_OF_LINE
    ]


def test_inspect_request_shows_the_life_the_log_lines_tell(served_run):
    lines = served_run.lines
    requeued = {x["request_id"] for x in lines if x["event"] == "request requeued"}
    for rid in evicted_ids(lines):
        view, shown = life_shown(served_run.log, rid)
        assert shown == life_logged(lines, rid), rid  # the same words at the same steps
        assert view["client_ids"] == [rid] and len(view["output_token_ids"]) == 40
        # its admission shares the 32-token system prompt; a re-admission after a preemption
        # may also find blocks of its own output still cached
        hits = [tokens for _, tokens, _ in view["hits"]]
        assert hits and hits[0] == 32 and all(t >= 32 and t % 16 == 0 for t in hits), hits
        assert view["shared_with"] and view["timed"]["ttft_s"] > 0
        assert sum(len(r["sampled"]) for r in view["rows"]) == 40
        ran = [r for r in view["rows"] if r["note"] != "executor lost: never ran"]
        assert all(r["batch_size"] >= 1 and r["live_bytes"] > 0 for r in ran)
        assert len(view["rows"]) - len(ran) <= (rid in requeued)


def rewritten(log: Path, into: Path, keep, format_version: int) -> Path:
    """The records of `log` that `keep` keeps, written as a log of `format_version`."""
    recording = load(log)
    header = {k: v for k, v in recording.header.items() if k not in _RESERVED_KEYS}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(events_log, "FORMAT_VERSION", format_version)
        with LogWriter(into, header) as writer:
            for rec in recording.records:
                if keep(rec):
                    writer.append(rec)
    return into


def not_preempted(rec: object) -> bool:
    return not isinstance(rec, RequestPreempted)


def test_the_log_records_each_preemption_and_requeue_the_lines_tell(served_run):
    recorded = [r for r in load(served_run.log).records if isinstance(r, RequestPreempted)]
    names = {
        r.request_id: r.client_id
        for r in load(served_run.log).records
        if isinstance(r, RequestNamed)
    }
    told = [
        (x["step"], x["request_id"], x["event"], x["tokens"])
        for x in served_run.lines
        if x["event"] in ("request preempted", "request requeued")
    ]
    words = {"preemption": "request preempted", "recovery": "request requeued"}
    as_lines = [(r.step, names[r.request_id], words[r.cause], r.num_tokens) for r in recorded]
    assert {"preemption", "recovery"} <= {r.cause for r in recorded}
    assert sorted(as_lines) == sorted(told)
    code, out, _ = memstep("inspect", str(served_run.log))  # and `inspect` counts them by cause
    by = {c: sum(r.cause == c for r in recorded) for c in ("preemption", "recovery")}
    counted = f"{by['preemption']} by preemption, {by['recovery']} by recovery"
    assert code == 0 and f"requests sent back to recompute: {counted}" in out


def test_the_served_log_replays_byte_for_byte_with_its_preemptions(served_run):
    recording = load(served_run.log)
    isolate_heap()
    run = replay(recording)
    preempted = [r for r in recording.records if isinstance(r, RequestPreempted)]
    assert [r for r in run.derived if isinstance(r, RequestPreempted)] == preempted
    assert replayable_bytes(run.derived) == replayable_bytes(recording.derived)
    assert build_report(recording, run).exit_code == 0


def test_a_log_without_its_preemptions_tells_another_life(served_run, tmp_path):
    """Broken on purpose: the served log less its RequestPreempted records, still claiming the
    format that holds them.  `inspect` then shows no preemption where the lines tell one, and
    replay finds the missing records (a divergence)."""
    doctored = rewritten(served_run.log, tmp_path / "doctored.memlog", not_preempted, 2)
    rid = next(r for r in evicted_ids(served_run.lines))
    assert life_shown(doctored, rid)[1] != life_logged(served_run.lines, rid)
    code, out, _ = memstep("replay", str(doctored))
    assert code == 1 and "RequestPreempted" in out


def test_a_format_1_log_still_reads_and_replays(served_run, tmp_path):
    """A log written before preemptions were recorded (format 1): replay compares only what it
    holds (exit 0), and `inspect` names each recomputation without saying why."""
    old = rewritten(served_run.log, tmp_path / "old.memlog", not_preempted, 1)
    assert load(old).format_version == 1
    code, out, err = memstep("replay", str(old))
    assert code == 0, out + err
    rid = next(r for r in evicted_ids(served_run.lines))
    again = [
        step
        for step, what in life_logged(served_run.lines, rid)
        if what in ("resumed", "re-admitted")
    ]
    view = life_shown(old, rid)[0]
    assert [step for step, what, _ in view["events"] if what == "recomputed"] == again


def test_inspect_request_text_names_it_by_any_id(served_run):
    core_id = core_id_of(served_run.lines, X_REQUEST_ID)
    ids = (X_REQUEST_ID, f"cmpl-{X_REQUEST_ID}", core_id)
    outs = [memstep("inspect", str(served_run.log), "--request", rid)[1] for rid in ids]
    assert outs[0] == outs[1] == outs[2]
    text = outs[0]
    assert f"client id: {core_id}" in text and "admitted: prefix hit 16 tokens" in text
    assert "steps that ran it: 5" in text and "text: " in text and "tokens: [" in text
    code, _, err = memstep("inspect", str(served_run.log), "--request", "nobody")
    assert code == 2 and "no request 'nobody'" in err


def test_inspect_requests_ranks_the_slowest(served_run):
    code, out, _ = memstep("inspect", str(served_run.log), "--requests", "3", "--json")
    ranked = json.loads(out)
    assert code == 0 and set(ranked) == {"ttft", "tpot", "queue"}
    finished = [r for r in load(served_run.log).records if isinstance(r, RequestFinished)]
    for field, rows in ranked.items():
        values = [r[field] for r in rows]
        assert len(rows) == 3 and values == sorted(values, reverse=True) and rows[0]["unit"] == "s"
    # TPOT: the 40-token streams that waited through preemptions and the recovery are slowest
    assert all(r["completion_tokens"] == 40 for r in ranked["tpot"]) and len(finished) == 10
    text = memstep("inspect", str(served_run.log), "--requests")[1]
    assert "slowest by time per output token (s):" in text and "zmq-" in text


# --- trace ------------------------------------------------------------------------------------

REQUIRED = {"ph", "name", "pid", "tid", "ts"}
PHASES = {"B", "E", "i", "C", "M", "b", "e"}


def trace_problems(trace: dict) -> list[str]:
    """What makes `trace` not a valid trace event file: a missing required field, an unknown
    phase, B/E not balanced per thread (or ended under another name), nestable async b/e not
    balanced per (cat, id), a counter that is not numbers."""
    problems: list[str] = []
    stacks: dict[tuple, list[str]] = {}
    for i, e in enumerate(trace.get("traceEvents", [])):
        missing = REQUIRED - set(e) if e.get("ph") != "M" else {"ph", "name", "pid"} - set(e)
        if missing or e.get("ph") not in PHASES:
            problems.append(f"event {i}: missing {sorted(missing)} or phase {e.get('ph')!r}")
            continue
        ph = e["ph"]
        if ph in "bBe" + "E":
            key = (e["pid"], e["tid"]) if ph in "BE" else (e.get("cat"), e.get("id"))
            stack = stacks.setdefault(key, [])
            if ph in "Bb":
                stack.append(e["name"])
            elif not stack or stack.pop() != e["name"]:
                problems.append(f"event {i}: {ph} {e['name']!r} ends nothing begun")
        if ph == "C" and not all(isinstance(v, int | float) for v in e["args"].values()):
            problems.append(f"event {i}: counter values must be numbers")
    problems += [f"{key}: {stack} never ended" for key, stack in stacks.items() if stack]
    return problems


@pytest.fixture(scope="module")
def trace(served_run, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("trace") / "trace.json"
    code, said, err = memstep("trace", str(served_run.log), "-o", str(out))
    assert code == 0 and "wrote" in said, err
    return json.loads(out.read_text())


def test_trace_is_a_valid_trace_event_file(served_run, trace):
    assert trace_problems(trace) == []
    events = trace["traceEvents"]
    steps = [e for e in events if e["ph"] == "B" and e["cat"] == "step"]
    ran = [r for r in load(served_run.log).records if isinstance(r, StepFinished)]
    assert {e["name"] for e in steps} == {"no_spec"} and len(steps) == len(ran) > 50
    names = {e["name"] for e in events if e["ph"] == "i"}
    assert {"executor lost", "recovered", "enter no_spec"} <= names
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"memory (MiB)", "KV pages", "host RSS (MiB)"}
    spans = [e for e in events if e["ph"] == "b" and "engine_id" in e["args"]]
    names = {e["name"] for e in spans}
    assert {"warm", core_id_of(served_run.lines, X_REQUEST_ID), "zmq-5"} <= names
    phases = {e["name"] for e in events if e["ph"] == "b" and e["cat"] == "request"}
    assert {"prefill", "decode", "preempted", "requeued"} <= phases  # named by the records


def test_the_trace_check_catches_each_fault(trace):
    events = trace["traceEvents"]
    first_end = next(i for i, e in enumerate(events) if e["ph"] == "E")
    no_end = events[:first_end] + events[first_end + 1 :]
    async_end = next(i for i, e in enumerate(events) if e["ph"] == "e")
    no_async_end = events[:async_end] + events[async_end + 1 :]
    no_ts = [dict(events[5]), *events[6:]]
    del no_ts[0]["ts"]
    for broken in (no_end, no_async_end, no_ts):
        assert trace_problems({"traceEvents": broken}) != []


def test_trace_filters_requests_and_steps(served_run, tmp_path):
    out = tmp_path / "part.json"
    code, _, _ = memstep(
        "trace", str(served_run.log), "-o", str(out), "--steps", "10:20", "--requests", "zmq-5"
    )
    part = json.loads(out.read_text())
    events = part["traceEvents"]
    assert code == 0 and trace_problems(part) == []
    steps = [e["args"]["step"] for e in events if e["ph"] == "B"]
    assert steps == list(range(10, 21))
    assert {e["id"] for e in events if e["ph"] == "b"} == {"req-6"}
    assert all(10_000 <= e["ts"] <= 21_000 for e in events if e["ph"] in "bBeEC")
    code, said, err = memstep("trace", str(served_run.log), "-o", str(out), "--max-requests", "2")
    assert code == 0 and "2 requests" in said and "drawing the 2 longest-lived" in err


def test_inspect_requests_of_an_offline_log_ranks_by_steps(tiny_log):
    """No server measured times: TTFT, TPOT and queue time are counted in steps."""
    code, out, _ = memstep("inspect", str(tiny_log.path), "--requests", "5", "--json")
    ranked = json.loads(out)
    assert code == 0 and all(r["unit"] == "steps" for rows in ranked.values() for r in rows)
    ttft = [r["ttft"] for r in ranked["ttft"]]
    assert len(ttft) == 5 and ttft == sorted(ttft, reverse=True) and ttft[-1] >= 1
    worst = ranked["ttft"][0]["engine_id"]
    life = json.loads(memstep("inspect", str(tiny_log.path), "--request", worst, "--json")[1])
    assert life["first_token_step"] - life["arrival_step"] + 1 == ranked["ttft"][0]["ttft"]
