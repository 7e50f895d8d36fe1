"""`memstep trace LOG -o trace.json`: the run as a Chrome trace, for Perfetto or chrome://tracing.

A long log makes a file too large for a browser: `--steps A:B` keeps a range of steps,
`--requests ID,...` only those requests, and without it at most `--max-requests` requests are
drawn (the longest-lived: the outliers a debugging session starts from).
"""

from __future__ import annotations

import argparse
import json
import sys

from memstep.cli.errors import UsageError
from memstep.replay.recording import load
from memstep.replay.trace import Window, chrome_trace, lives


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", help="the event log (its rotated parts LOG.1, LOG.2, ... are read too)")
    p.add_argument("-o", "--output", default="trace.json", help="file to write (trace.json)")
    p.add_argument("--steps", metavar="A:B", help="only steps A to B (either side may be empty)")
    p.add_argument(
        "--requests", metavar="ID,...", help="only these requests (engine or client ids)"
    )
    p.add_argument(
        "--max-requests",
        type=int,
        default=1000,
        help="without --requests, draw at most this many requests, the longest-lived (1000)",
    )


def run(args: argparse.Namespace) -> int:
    recording = load(args.log)
    if recording.problems:
        print(f"memstep: warning: {recording.describe_problem()}", file=sys.stderr)
    first, last = _step_range(args.steps)
    wanted = _requests(args, recording.records, first, last)
    trace = chrome_trace(recording.records, Window(first, last, wanted))
    with open(args.output, "w") as f:
        json.dump(trace, f, separators=(",", ":"))
    num = sum(
        e["ph"] == "b" and e["args"].get("engine_id") is not None for e in trace["traceEvents"]
    )
    print(f"wrote {args.output}: {len(trace['traceEvents'])} events, {num} requests")
    return 0


def _step_range(text: str | None) -> tuple[int, int]:
    if not text:
        return 0, 1 << 62
    lo, sep, hi = text.partition(":")
    try:
        return int(lo or 0), int(hi) if hi else 1 << 62
    except ValueError:
        raise UsageError(f"--steps {text!r}: expected A:B, step numbers") from None


def _requests(args: argparse.Namespace, records: list, first: int, last: int) -> frozenset | None:
    if args.requests:
        return frozenset(args.requests.split(","))
    alive = {
        rid: life
        for rid, life in lives(records).items()
        if life.arrival <= last and (life.finish is None or life.finish >= first)
    }
    if len(alive) <= args.max_requests:
        return None if len(alive) == len(lives(records)) else frozenset(alive)
    end = {
        rid: (life.finish if life.finish is not None else last) - life.arrival
        for rid, life in alive.items()
    }
    kept = sorted(alive, key=lambda rid: -end[rid])[: args.max_requests]
    print(
        f"memstep: {len(alive)} requests in range; drawing the {len(kept)} longest-lived "
        "(--max-requests, --requests)",
        file=sys.stderr,
    )
    return frozenset(kept)
