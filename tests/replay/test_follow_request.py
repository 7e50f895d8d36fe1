"""Following one request through a served run (`served_run`: ZMQ and HTTP, a prefix hit,
preemptions, an executor SIGKILL and its recovery): its JSON log lines, `inspect --request`,
`inspect --requests` and `trace`."""

from __future__ import annotations

import json
import random
import re

import pytest
from replay_helpers import memstep
from served_run import X_REQUEST_ID

from memstep.events.types import RequestFinished, StepFinished
from memstep.replay.recording import load

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
    life = life_of(served_run.lines, f"cmpl-{X_REQUEST_ID}-0")
    assert life[0]["x_request_id"] == X_REQUEST_ID and life[0]["http_id"] == f"cmpl-{X_REQUEST_ID}"
    assert reads_in_order(life), [x["event"] for x in life]
    assert life[-1]["completion_tokens"] == 5


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
    "first token": "first token",
    "request resumed": "resumed",
    "request requeued": "requeued",
    "request re-admitted": "re-admitted",
}


def test_inspect_request_shows_the_life_the_log_lines_tell(served_run):
    lines = served_run.lines
    rids = sorted({x["request_id"] for x in lines if x["event"] in ("request preempted",
                   "request requeued")})  # fmt: skip
    for rid in rids:
        code, out, err = memstep("inspect", str(served_run.log), "--request", rid, "--json")
        assert code == 0, err
        view = json.loads(out)
        requeued = {x["request_id"] for x in lines if x["event"] == "request requeued"}
        logged = [(x["step"], VIEW_OF_LINE[x["event"]]) for x in life_of(lines, rid)
                  if x["event"] in VIEW_OF_LINE]  # fmt: skip
        shown = [(step, what) for step, what, _ in view["events"] if what in VIEW_OF_LINE.values()]
        # the log records no preemption, so a request requeued by the executor loss while it
        # waited out of the batch can look preempted to inspect (a known gap, see the docs)
        if rid not in requeued:
            assert shown == logged, rid
        else:
            steps = {step for step, what in logged if what != "requeued"}
            assert steps <= {step for step, _ in shown}, rid  # the same steps, if not words
        assert view["client_ids"] == [rid] and len(view["output_token_ids"]) == 40
        assert view["hits"] and all(tokens == 32 for _, tokens, _ in view["hits"])
        assert view["shared_with"] and view["timed"]["ttft_s"] > 0
        assert sum(len(r["sampled"]) for r in view["rows"]) == 40
        ran = [r for r in view["rows"] if r["note"] != "executor lost: never ran"]
        assert all(r["batch_size"] >= 1 and r["live_bytes"] > 0 for r in ran)
        assert len(view["rows"]) - len(ran) == (rid in requeued)


def test_inspect_request_text_names_it_by_any_id(served_run):
    ids = (X_REQUEST_ID, f"cmpl-{X_REQUEST_ID}", f"cmpl-{X_REQUEST_ID}-0")
    outs = [memstep("inspect", str(served_run.log), "--request", rid)[1] for rid in ids]
    assert outs[0] == outs[1] == outs[2]
    text = outs[0]
    assert f"client id: cmpl-{X_REQUEST_ID}-0" in text and "admitted: prefix hit 16 tokens" in text
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
    assert all(r["completion_tokens"] == 40 for r in ranked["tpot"]) and len(finished) == 8
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
    assert {e["name"] for e in spans} >= {"warm", f"cmpl-{X_REQUEST_ID}-0", "zmq-5"}
    phases = {e["name"] for e in events if e["ph"] == "b" and e["cat"] == "request"}
    assert {"prefill", "decode", "waiting"} <= phases


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
    code, _, _ = memstep("trace", str(served_run.log), "-o", str(out), "--steps", "10:20",
                         "--requests", "zmq-5")  # fmt: skip
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
