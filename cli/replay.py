"""Replay an event log through a fresh engine and report the first divergence.

Exit 0 when every derived record is reproduced (a what-if run with --set reports what changed
and exits 0), 1 on a divergence, 2 when the file is not a log this memstep can read, 3 when the
log is corrupt mid-file (records lost with intact records after them): the records before the
first gap are replayed and checked, the records recovered after it are reported but cannot be
replayed exactly (a lost record may have been an input).  A damaged tail (torn by a crash
mid-write) is reported and the intact prefix replayed; that alone is not a failure.
"""

from __future__ import annotations

import argparse
import json
import sys

from memstep.cli import router_log
from memstep.cli.progress import Progress, add_progress_argument
from memstep.core.config import parse_override
from memstep.events.types import StepFinished
from memstep.replay.recording import load
from memstep.replay.replayer import ReplayStalled, replay
from memstep.replay.report import EXIT_CORRUPT, EXIT_DIVERGED, build_report
from memstep.router.replay import is_router_log

EXIT_CODES = (
    f"exit codes: 0 identical (a torn tail is only a warning), {EXIT_DIVERGED} diverged (in what "
    f"was checked), 2 not a readable log or bad arguments, {EXIT_CORRUPT} corrupt log: records "
    "lost mid-file, only the records before the first gap replayed and checked"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EXIT_CODES
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
    add_progress_argument(p)


def run(args: argparse.Namespace) -> int:
    if is_router_log(args.log):  # serve --data-parallel-size: the router's own log
        return router_log.replay(args)
    overrides = dict(parse_override(text) for text in args.overrides)
    recording = load(args.log)
    problem = recording.describe_problem()
    if problem is not None:
        what = "the records before the first gap" if recording.is_corrupt else "what it holds"
        print(f"memstep: warning: {problem}; replaying {what}", file=sys.stderr)
    steps = sum(isinstance(r, StepFinished) for r in recording.records)
    try:
        with Progress(steps, "replay", "step", StepFinished, args.disable_tqdm) as bar:
            replay_run = replay(recording, overrides, sinks=(bar,))
    except ReplayStalled as exc:
        print(f"memstep: replay stalled: {exc}", file=sys.stderr)
        return 1
    report = build_report(recording, replay_run, overrides)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_text())
    return report.exit_code
