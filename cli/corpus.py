"""`memstep scenario corpus`: every case of cli/corpus_cases.py run on the real model, judged
as a leak detector is judged: clean traffic must give no leak report, every planted leak must be
caught; the confusion matrix and each catch's time to detect (steps and seconds from the first
serving step) are printed.

A plant a device cannot show (`states/planted.py`'s REFUSED) is refused by the engine with its
reason, and counted as refused, not as a catch or a miss.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import attrs

from memstep.cli.corpus_cases import BASE, CASES, GUIDES, Case, Traffic
from memstep.core.config import ConfigError, EngineConfig
from memstep.core.engine import Engine
from memstep.core.growth import StepWork
from memstep.core.sampling_params import SamplingParams
from memstep.events.types import (
    ExecutorLost,
    LeakSuspected,
    StepFinished,
    StepPlanned,
    is_leak,
)
from memstep.executors.process.inprocess import local_engine
from memstep.executors.runtime.leak_detector import LeakDetector

WORDS = [
    "the",
    "keeper",
    "walked",
    "along",
    "the",
    "shore",
    "and",
    "counted",
    "every",
    "wave",
    "that",
    "broke",
    "on",
    "the",
    "old",
    "stones",
]


@attrs.frozen
class Outcome:
    case: Case
    records: list[object]
    times: list[float]  # each record's arrival, monotonic seconds
    refused: str | None = None

    @property
    def leaks(self) -> list[LeakSuspected]:
        return [r for r in self.records if is_leak(r)]

    @property
    def num_steps(self) -> int:
        return sum(1 for r in self.records if isinstance(r, StepFinished))

    @property
    def verdict(self) -> str:
        if self.refused:
            return "refused"
        if self.case.expect is None:
            return "ok" if not self.leaks else "FALSE ALARM"
        caught = any(leak.what == self.case.expect for leak in self.leaks)
        return "caught" if caught else "MISSED"

    def time_to_detect(self) -> tuple[int, float] | None:
        """Steps and seconds from the first serving step to the step whose result carried the
        first leak report; None where there is none."""
        first = last = None
        for rec, at in zip(self.records, self.times, strict=True):
            if isinstance(rec, StepFinished) and rec.kind in ("spec", "no_spec"):
                first = first or (rec.step, at)
                last = (rec.step, at)
            elif is_leak(rec) and first is not None and last is not None:
                return last[0] - first[0], at - first[1]
        return None


def run_case(case: Case, model: str = "smollm2", device: str = "auto") -> Outcome:
    records: list[object] = []
    times: list[float] = []

    def sink(rec: object) -> None:
        records.append(rec)
        times.append(time.monotonic())

    fields = {**BASE, **case.config}
    if fields.get("speculative_method") == "eagle" and model != "smollm2":
        fields["speculative_method"] = "ngram"  # a trained head exists for smollm2 only
    try:
        cfg = EngineConfig(model=model, device=device, debug_plant_leak=case.plant, **fields)
        engine = local_engine(cfg, [sink])
    except ConfigError as e:
        return Outcome(case, [], [], refused=str(e))
    try:
        drive(engine, case.traffic)
    finally:
        engine.shutdown()
    return Outcome(case, records, times)


def drive(engine: Engine, traffic: Traffic) -> None:
    """Add a burst every `traffic.every` steps (at once when the engine runs dry), then drain."""
    tok = engine.tokenizer
    for burst in range(traffic.num_bursts):
        for i in range(traffic.burst):
            n = burst * traffic.burst + i
            text = " ".join(WORDS[(n + j) % len(WORDS)] for j in range(traffic.prompt_words))
            ids = tok.encode_chat([{"role": "user", "content": f"{n}: {text}"}])
            ids = ids[: engine.max_model_len - traffic.max_tokens - 1]  # the model's context
            engine.add_request(ids, _params(traffic, n), request_id=f"c{n}")
        for _ in range(traffic.every if burst + 1 < traffic.num_bursts else 0):
            if not engine.has_work():
                break
            engine.step()
    engine.run_until_idle()


def _params(traffic: Traffic, n: int) -> SamplingParams:
    guide = GUIDES[n % len(GUIDES)] if traffic.guided else {}
    fields = {"temperature": 0.8, "seed": n, "max_tokens": traffic.max_tokens}
    return SamplingParams(**fields, ignore_eos=not guide, **traffic.params, **guide)


def run_corpus(
    cases: Iterable[Case] = CASES,
    model: str = "smollm2",
    device: str = "cpu",
    done: Callable[[Outcome], None] = lambda o: None,
) -> list[Outcome]:
    """Every case for `device` ("cpu": those not for CUDA only), in order."""
    out = []
    for case in cases:
        if case.device == "cuda" and device == "cpu":
            continue
        outcome = run_case(case, model, device)
        done(outcome)
        out.append(outcome)
    return out


def rejudge(outcome: Outcome) -> Outcome:
    """`outcome` judged again from its recorded figures by a fresh detector (the executor's
    rule for device figures and its own host memory), as a replay would: the rule the corpus
    ran must give the same verdicts, and another rule (a test's plant) its own."""
    if outcome.refused:
        return outcome
    detector, seen = LeakDetector(), set[str]()
    records: list[object] = []
    work = StepWork(0, 0, 0)
    for rec in outcome.records:
        if isinstance(rec, ExecutorLost):
            detector = LeakDetector()  # a new executor judges afresh
        elif isinstance(rec, StepPlanned):
            new = {row[0] for row in rec.batch} - seen
            seen |= new
            work = StepWork(len(rec.batch), rec.num_tokens, len(new))
        elif isinstance(rec, StepFinished) and rec.kind in ("spec", "no_spec"):
            records += [rec, *detector.observe(rec.step, rec.kind, rec.memory, work)]
    return Outcome(outcome.case, records, [0.0] * len(records))


def confusion(outcomes: list[Outcome]) -> dict[str, int]:
    """Planted leaks caught or missed, clean cases silent or alarmed, plants refused."""
    count = {"caught": 0, "MISSED": 0, "ok": 0, "FALSE ALARM": 0, "refused": 0}
    for o in outcomes:
        count[o.verdict] += 1
    return count


def format_outcomes(outcomes: list[Outcome]) -> str:
    head = f"{'case':<26} {'plant':<26} {'steps':>5} {'leaks':>5} {'detect':>14}  verdict"
    lines = [head, "-" * len(head)]
    for o in outcomes:
        t = o.time_to_detect()
        detect = f"{t[0]} st {t[1]:.1f} s" if t else "-"
        lines.append(
            f"{o.case.name:<26} {o.case.plant or '-':<26} {o.num_steps:>5} {len(o.leaks):>5} "
            f"{detect:>14}  {o.verdict}"
        )
        lines += [f"    {leak.what} at step {leak.step}: {leak.detail}" for leak in o.leaks[:2]]
        if o.refused:
            lines.append(f"    refused: {o.refused}")
    c = confusion(outcomes)
    lines += [
        "",
        f"{'':<16} {'reported':>9} {'silent':>7}",
        f"{'planted leak':<16} {c['caught']:>9} {c['MISSED']:>7}",
        f"{'clean traffic':<16} {c['FALSE ALARM']:>9} {c['ok']:>7}",
        f"refused plants: {c['refused']}",
    ]
    return "\n".join(lines)
