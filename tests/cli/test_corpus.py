"""The leak corpus (cli/corpus.py) on the CPU: no leak report in any clean traffic shape, every
planted leak caught and its time to detect printed, the same verdicts when the recorded figures
are judged again, and a detector planted back to a fixed tolerance failing it both ways (a
false alarm with a small one, a miss with a large one)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memstep.cli import corpus
from memstep.cli.corpus_cases import CASES
from memstep.core import growth, host_memory
from memstep.events import codec
from memstep.events.types import ExecutorLost, RequestPreempted, StepFinished
from memstep.executors.runtime import leak_detector

MIB = 1 << 20


# the corpus in a process of its own, each outcome a JSON line of its case, arrival times and
# its records in the log's codec (nothing pickled)
RUN_CORPUS = """
import json
from memstep.cli import corpus
from memstep.events import codec
for o in corpus.run_corpus(model="random:tiny", device="cpu"):
    records = [codec.encode(r).hex() for r in o.records]
    print(json.dumps({"case": o.case.name, "refused": o.refused, "times": o.times,
                      "records": records}), flush=True)
"""


@pytest.fixture(scope="module")
def outcomes() -> list[corpus.Outcome]:
    """Run in a fresh process: a host plant shows in the resident figure only where the heap has
    no freed, still-resident memory to hand it (a long-lived test worker has plenty: in a full
    suite's worker every host plant went unseen, as it would in such a server until its free heap
    ran out)."""
    done = subprocess.run(
        [sys.executable, "-c", RUN_CORPUS], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    cases = {c.name: c for c in CASES}
    out = []
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            o = json.loads(line)
            records = [codec.decode(bytes.fromhex(r)) for r in o["records"]]
            out.append(corpus.Outcome(cases[o["case"]], records, o["times"], o["refused"]))
    print("\n" + corpus.format_outcomes(out))  # the table and each catch's time to detect
    return out


def test_clean_traffic_is_silent_and_every_planted_leak_is_caught(outcomes):
    table = corpus.format_outcomes(outcomes)
    verdicts = {o.case.name: o.verdict for o in outcomes}
    assert {o.case.name for o in outcomes} == {c.name for c in CASES if c.device != "cuda"}
    for o in outcomes:
        want = "ok" if o.case.expect is None else "caught"
        assert o.verdict == want, f"{o.case.name}: {o.verdict}\n{table}"
        if o.case.expect is not None:
            steps, seconds = o.time_to_detect()
            assert steps >= 0 and seconds >= 0 and f"{steps} st" in table
    caught = sum(1 for v in verdicts.values() if v == "caught")
    want = {"caught": caught, "MISSED": 0, "ok": 8, "FALSE ALARM": 0, "refused": 0}
    assert corpus.confusion(outcomes) == want


def test_the_clean_shapes_are_what_they_say(outcomes):
    by_name = {o.case.name: o for o in outcomes}
    batches = [
        len(r.sampled) for r in by_name["bursts-of-16"].records if isinstance(r, StepFinished)
    ]
    assert max(batches) == 16
    assert any(isinstance(r, RequestPreempted) for r in by_name["preemption"].records)
    kinds = {r.kind for r in by_name["speculation-on"].records if isinstance(r, StepFinished)}
    assert "spec" in kinds
    restart = by_name["executor-restart"].records
    assert any(isinstance(r, ExecutorLost) for r in restart)


def test_judging_the_recorded_figures_again_gives_the_same_verdicts(outcomes):
    again = [corpus.rejudge(o) for o in outcomes]
    assert [o.verdict for o in again] == [o.verdict for o in outcomes]


class FixedTolerance:
    """The rule this detector replaced, planted back: growth past a fixed number of bytes over
    the first level is a leak, whatever its shape."""

    tolerance = 0

    def __init__(self, rule: growth.GrowthRule):
        self.base: growth.Mark | None = None
        self.level = 0

    def level_at(self, step: int) -> int:
        return self.level

    def observe(self, step: int, value: int, work: growth.StepWork):
        mark = growth.Mark(step, 0, 0, value)
        if self.base is None:
            self.base = mark
            return None
        if value - self.base.floor <= self.tolerance:
            return None
        base, self.base, self.level = self.base, mark, value
        return growth.Slope(base, base, mark)


@pytest.mark.parametrize(("tolerance", "failure"), [(1 * MIB, "FALSE ALARM"), (64 * MIB, "MISSED")])
def test_a_fixed_tolerance_fails_the_corpus(outcomes, monkeypatch, tolerance, failure):
    monkeypatch.setattr(FixedTolerance, "tolerance", tolerance)
    monkeypatch.setattr(leak_detector, "FloorWatch", FixedTolerance)
    monkeypatch.setattr(host_memory, "FloorWatch", FixedTolerance)
    again = [corpus.rejudge(o) for o in outcomes]
    assert corpus.confusion(again)[failure] > 0, corpus.format_outcomes(again)


def test_the_cpu_refuses_the_fragmentation_plant_and_says_why():
    """`scenario sampler-rise --plant-leak fragmenting_scratch` exited 0 on the CPU, silent:
    the engine now refuses to start with it there, and says why."""
    case = next(c for c in CASES if c.plant == "fragmenting_scratch")
    outcome = corpus.run_case(case, "random:tiny", "cpu")
    assert outcome.verdict == "refused" and "caching allocator" in (outcome.refused or "")
