"""Progress with an ETA for long commands (`replay`, `bench offline`, `scenario`).

A `Progress` is an engine sink: it moves a tqdm bar on stderr by one for each record of the type
it counts (StepFinished for steps, RequestFinished for requests), so a command shows how far it
is without the engine knowing of bars.  stdout keeps only the command's result, and
`--disable-tqdm` turns the bar off (tqdm writes nothing at all then).
"""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from memstep.events.log import ClosedOnExit


def add_progress_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--disable-tqdm", action="store_true", help="no progress bar on stderr (default: shown)"
    )


class Progress(ClosedOnExit):
    """A tqdm bar of `total` units on stderr, moved by each record of type `counts`."""

    def __init__(self, total: int | None, desc: str, unit: str, counts: type, disable: bool):
        self.counts = counts
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=disable)

    def __call__(self, rec: object) -> None:
        if isinstance(rec, self.counts):
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
