"""Replay an event log through a fresh engine and report the first divergence.

Exit 0 when every derived record is reproduced (a what-if run with --set reports what changed
and exits 0), 1 on a divergence, 2 when the file is not a log this memstep can read.  A damaged
log (torn or corrupt tail) is reported and its intact prefix replayed.
"""

from __future__ import annotations

import argparse
import json
import sys

from memstep.core.config import parse_override
from memstep.events.log import LogFormatError
from memstep.replay.recording import load
from memstep.replay.replayer import ReplayStalled, replay
from memstep.replay.report import build_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", help="the event log (its rotated parts LOG.1, LOG.2, ... are read too)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="what-if run: override an engine config field (repeatable); reports differences",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    overrides = dict(parse_override(text) for text in args.overrides)
    try:
        recording = load(args.log)
    except LogFormatError as exc:
        print(f"memstep: error: {exc}", file=sys.stderr)
        return 2
    problem = recording.describe_problem()
    if problem is not None:
        print(f"memstep: warning: {problem}; replaying what it holds", file=sys.stderr)
    try:
        replay_run = replay(recording, overrides)
    except ReplayStalled as exc:
        print(f"memstep: replay stalled: {exc}", file=sys.stderr)
        return 1
    report = build_report(recording, replay_run, overrides)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_text())
    return report.exit_code
