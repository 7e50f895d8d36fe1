"""A replay watches no host memory: its executor runs in the replay's process, whose resident
set also holds what the replay keeps (every replayed record, for the comparison), and the OS's
figures are left out of the comparison anyway. Served, the same growth is reported."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from replay_helpers import isolate_heap

from memstep.core.config import EngineConfig
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import LeakSuspected, StepFinished
from memstep.executors.process.inprocess import local_engine
from memstep.replay.recording import load
from memstep.replay.replayer import replay

HOARD_MIB, STEP_MIB = 96, 4  # 4 MiB a step: a slope, window after window
WARM = 24  # the host watch's warm-up: three windows of 8 steps


def hoarder(
    hoard: list[mmap.mmap], reports: list[object], after: int = 0
) -> Callable[[object], None]:
    """A sink that keeps STEP_MIB of touched pages for each step it sees after the first `after`
    (up to HOARD_MIB), as a replay keeps records, and collects the host-growth reports. The
    pages are mapped anew (the heap could hand back pages that earlier tests freed and that are
    resident already)."""
    seen = [0]

    def sink(record: object) -> None:
        if isinstance(record, StepFinished):
            seen[0] += 1
        if (
            seen[0] > after
            and isinstance(record, StepFinished)
            and len(hoard) < HOARD_MIB // STEP_MIB
        ):
            pages = mmap.mmap(-1, STEP_MIB << 20)
            pages.write(b"x" * (STEP_MIB << 20))
            hoard.append(pages)
        if isinstance(record, LeakSuspected) and record.what == "host_growth":
            reports.append(record)

    return sink


def test_a_replay_reports_no_host_growth_of_what_its_process_holds(tiny_log):
    hoard: list[mmap.mmap] = []
    reports: list[object] = []
    isolate_heap()
    run = replay(load(tiny_log.path), sinks=(hoarder(hoard, reports),))
    assert len(hoard) == HOARD_MIB // STEP_MIB and len(run.derived) > 100
    assert not reports


def test_a_served_engine_reports_the_same_growth():
    """The check the replay leaves out still fires where an engine serves: the same hoard beside
    an in-process engine is its process's growth.  In a process of its own: a test worker that
    has run a suite's other tests holds freed, resident heap whose return to the system can
    hide a growth of its resident set."""
    code = f"import runpy; runpy.run_path({__file__!r})['served_growth']()"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]


def served_growth() -> None:
    hoard: list[mmap.mmap] = []
    reports: list[object] = []
    engine = local_engine(
        EngineConfig(model="random:tiny", max_num_seqs=2), sinks=[hoarder(hoard, reports, WARM)]
    )
    steps = WARM + HOARD_MIB // STEP_MIB + 16
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    engine.shutdown()
    assert len(hoard) == HOARD_MIB // STEP_MIB
    assert reports and all(r.step <= WARM + HOARD_MIB // STEP_MIB + 2 for r in reports)
