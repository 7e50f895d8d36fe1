"""Benchmarks: `bench offline` (engine vs Hugging Face) and `bench serve` (load over the API)."""

from __future__ import annotations

import argparse
import importlib

from memstep.cli.config_file import add_config_argument
from memstep.cli.help_format import HelpFormatter, add_help_all

MODES = {"offline": "memstep.cli.bench_offline", "serve": "memstep.cli.bench_serve"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="mode", required=True)
    for mode, module_name in MODES.items():
        module = importlib.import_module(module_name)
        q = sub.add_parser(
            mode,
            help=(module.__doc__ or "").strip().splitlines()[0],
            formatter_class=HelpFormatter,
        )
        module.add_arguments(q)
        add_help_all(q)
        add_config_argument(q)
        q.set_defaults(bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args.bench_run(args) or 0)
