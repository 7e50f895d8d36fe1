"""Plot an event log's memory over steps, step kinds as bands, transitions and leaks marked."""

from __future__ import annotations

import argparse
import sys

from memstep.replay.recording import load
from memstep.replay.timeline import plot_memory


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", help="the event log (its rotated parts LOG.1, LOG.2, ... are read too)")
    p.add_argument("-o", "--output", default="mem.png", help="PNG file to write (default mem.png)")


def run(args: argparse.Namespace) -> int:
    recording = load(args.log)
    try:
        path = plot_memory(recording, args.output)
    except ValueError as exc:
        print(f"memstep: error: {exc}", file=sys.stderr)
        return 2
    if recording.problems:
        print(f"memstep: warning: {recording.describe_problem()}", file=sys.stderr)
    print(f"wrote {path}")
    return 0
