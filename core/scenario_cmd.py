"""Run a memory-incident scenario and print the per-kind verdict; exit 1 on a leak."""

from __future__ import annotations

import argparse

from memstep.core.scenarios import SCENARIOS, format_table, run_scenario
from memstep.events.types import LeakSuspected
from memstep.states.planted import PLANTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(SCENARIOS))
    p.add_argument("--steps", type=int, default=2000, help="length of the sustained stretch")
    p.add_argument("--model", default="smollm2")
    p.add_argument(
        "--plant-leak",
        choices=sorted(PLANTS),
        default=None,
        help="test-only: run with a deliberate leak to see the detector fire",
    )
    p.add_argument("--record", default=None, help="write the event log here")


def run(args: argparse.Namespace) -> int:
    sinks = []
    recorder = None
    if args.record:
        from memstep.core.recorder import open_recorder

        recorder = open_recorder(args.record)
        sinks.append(recorder)
    records, rows = run_scenario(args.name, args.steps, args.model, args.plant_leak, sinks)
    if recorder is not None:
        recorder.close()
    leaks = [r for r in records if isinstance(r, LeakSuspected)]
    print(f"scenario {args.name}, model {args.model}, sustained steps {args.steps}")
    print(format_table(rows, leaks))
    return 1 if any(r.verdict != "ok" for r in rows) else 0
