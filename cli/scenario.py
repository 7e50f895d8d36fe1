"""Run a memory-incident scenario and print the per-kind verdict; exit 1 on a leak.  `corpus`
runs the leak corpus (cli/corpus.py): its confusion matrix and times to detect; exit 1 on a false
alarm or a missed leak."""

from __future__ import annotations

import argparse

from memstep.cli.main import SPECULATION_FIELDS, add_speculation_arguments
from memstep.cli.progress import Progress, add_progress_argument
from memstep.cli.scenarios import SCENARIOS, format_table, num_driven_steps, run_scenario
from memstep.events.types import LeakSuspected, StepFinished
from memstep.replay.recorder import add_record_arguments, open_recorder
from memstep.states.planted import PLANTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=[*sorted(SCENARIOS), "corpus"])
    p.add_argument("--steps", type=int, default=2000, help="length of the sustained stretch")
    p.add_argument("--model", default="smollm2", help="the model the scenario runs")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where")
    p.add_argument(
        "--plant-leak",
        choices=sorted(PLANTS),
        default=None,
        help="test-only: run with a deliberate leak to see the detector fire",
    )
    g = p.add_argument_group("speculation (the scenario's own settings unless given)")
    add_speculation_arguments(g, None)
    add_record_arguments(p, by_default=True)
    add_progress_argument(p)


def run(args: argparse.Namespace) -> int:
    if args.name == "corpus":
        return run_corpus_command(args)
    recorder = open_recorder(args)
    sinks = [recorder] if recorder is not None else []
    given = {
        name: getattr(args, name) for name in SPECULATION_FIELDS if getattr(args, name) is not None
    }
    total = num_driven_steps(args.name, args.steps)
    with Progress(total, args.name, "step", StepFinished, args.disable_tqdm) as bar:
        overrides = {**given, "device": args.device}
        records, rows = run_scenario(
            args.name, args.steps, args.model, args.plant_leak, [*sinks, bar], overrides=overrides
        )
    if recorder is not None:
        recorder.close()
    leaks = [r for r in records if isinstance(r, LeakSuspected) and r.is_leak]
    settings = "".join(f", {k}={v}" for k, v in given.items())
    print(f"scenario {args.name}, model {args.model}, sustained steps {args.steps}{settings}")
    print(format_table(rows, leaks))
    if recorder is not None:
        print(f"event log: {', '.join(str(p) for p in recorder.parts)}")
    return 1 if any(r.verdict != "ok" for r in rows) else 0


def run_corpus_command(args: argparse.Namespace) -> int:
    """Every corpus case for the device (the CUDA half only where it is CUDA), printed as each
    ends, then the table and the confusion matrix."""
    from memstep.cli.corpus import confusion, format_outcomes, run_corpus
    from memstep.core.config import EngineConfig
    from memstep.executors.runtime.worker import pick_device

    device = pick_device(EngineConfig(device=args.device)).type
    done = lambda o: print(f"{o.case.name}: {o.verdict}", flush=True)  # noqa: E731
    outcomes = run_corpus(model=args.model, device=device, done=done)
    print(f"leak corpus, model {args.model}, device {device}")
    print(format_outcomes(outcomes))
    c = confusion(outcomes)
    return 1 if c["MISSED"] or c["FALSE ALARM"] else 0
