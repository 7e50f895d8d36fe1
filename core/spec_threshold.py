"""Which step kind a batch runs: `spec` only at the batch sizes where speculation pays.

A user's `speculative_disable_by_batch_size` rules when given. Otherwise, with speculation on and
`speculative_auto_disable` (the default), the core chooses the threshold itself: per batch-size
bucket (powers of two: 1, 2-3, 4-7, 8-15, ...) it keeps the tokens per second of the latest pure
decode steps of each kind, and disables speculation from the smallest bucket where `spec` makes
fewer tokens per second than `no_spec`.

Both kinds stay measured by probes: a decode step runs the kind the threshold does not pick
while that kind has fewer than `MIN_SAMPLES` steps in the bucket, then once after a gap that
doubles after each probe up to `MAX_PROBE_PERIOD`. After a change the first gap is
`PROBE_PERIOD`, or more where the change's rates make a probe dear (`probe_gaps`: probes lose at
most `PROBE_BUDGET` of the bucket's time). A `spec` step right after a `no_spec` one re-enters
the kind (an EAGLE head has no fresh state) and is neither counted nor measured, so a spec probe
runs `PAIRED` counted steps after it. Probes depend only on counts of steps and on the recorded
changes and gaps, so a replay makes the same ones.

The threshold depends on wall time, which no replay can measure again: the engine records each
change (`SpecThresholdChanged`, an input) and a replay applies it (`set`) instead of deciding
(`decide`). A new threshold is held `HOLD_STEPS` decode steps unless a bucket's verdict is
decisive (`DECISIVE`; past one stream also windows apart by `DECISIVE_WINDOWS`, before any pair).
Load that comes and goes on a shared machine reads as one kind's loss when the windows are made
at other times, so the ratio is the median of paired ratios once there are `MIN_SAMPLES`: each
probe's steps against the last `PAIRED` steps before it; spec goes off only below
`DISABLE_RATIO`, a margin as on the way back (docs/speculation.md has the measurements).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

import attrs

from memstep.core.config import EngineConfig

MIN_SAMPLES = 3  # steps of each kind in a bucket before it is judged
PROBE_PERIOD = 32  # decode steps of a bucket before its first periodic probe of the other kind
MAX_PROBE_PERIOD = 512  # the gap between probes doubles up to this
WINDOW = 16  # the latest steps of each kind and bucket that the rates are made of
HOLD_STEPS = 16  # decode steps a new threshold is kept before the rates are judged again
# speculation switched off in a bucket comes back on only above this ratio to `no_spec`: a
# margin against switching on and off on noise
REENABLE_RATIO = 1.03
DISABLE_RATIO = 0.97  # and goes off only below this: a tie is noise
PAIRED = 3  # the other kind's latest steps that a step after a switch is compared with
DECISIVE = 0.8  # a bucket's spec/no_spec ratio below this (above its inverse, spec off) is judged
# past one stream, the windows' ratio (no pairs yet) below this, or above its inverse, is judged
DECISIVE_WINDOWS = 0.5
PROBE_BUDGET = 0.02  # the share of a bucket's time its periodic probes may lose, at most
PROBE_STEPS = PAIRED + 1  # a spec probe's steps: a re-entry, then PAIRED counted ones


def _probe_after(done: int, gap: int = PROBE_PERIOD) -> tuple[int, int]:
    """A bucket's probe schedule started at `done` counted steps with a first `gap`: (the
    counted steps at its next probe, the gap after it)."""
    return done + gap - 1, gap


def probe_gaps(threshold: int | None, rates: list[list]) -> list[list[int]]:
    """[[bucket, first gap], ...] past PROBE_PERIOD where the kind a new `threshold` does not
    pick measured slower (`rates`: [bucket, spec tok/s, no_spec tok/s] as `figures` gives):
    a probe step loses about the slower kind's extra time over the faster's (spec/no_spec - 1,
    or its inverse, in steps), and the gap holds PROBE_STEPS of them under PROBE_BUDGET."""
    gaps = []
    for bucket, spec, plain in rates:
        if spec <= 0 or plain <= 0:
            continue
        on = threshold is None or bucket < threshold
        loss = spec / plain - 1 if on else plain / spec - 1
        gap = min(math.ceil(PROBE_STEPS * loss / PROBE_BUDGET), MAX_PROBE_PERIOD)
        if gap > PROBE_PERIOD:
            gaps.append([int(bucket), gap])
    return gaps


def bucket_of(batch_size: int) -> int:
    """The power of two at or below `batch_size`: the bucket its step costs are kept in."""
    return 1 << (batch_size.bit_length() - 1)


@attrs.define
class Rate:
    """Tokens and seconds of a kind's latest decode steps in one bucket."""

    tokens: deque[int] = attrs.Factory(lambda: deque(maxlen=WINDOW))
    seconds: deque[float] = attrs.Factory(lambda: deque(maxlen=WINDOW))

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens.append(tokens)
        self.seconds.append(seconds)

    @property
    def per_second(self) -> float:
        """The median step's tokens per second: a step that lost the CPU to another process
        (a shared machine) moves it little."""
        rates = [t / s for t, s in zip(self.tokens, self.seconds, strict=True) if s > 0]
        return statistics.median(rates) if rates else 0.0


@attrs.define
class Run:
    """Measured steps of one kind in a row in a bucket: the rates of its first and its last
    PAIRED, and the last PAIRED of the run before it."""

    kind: str
    before: list[float]
    first: list[float] = attrs.Factory(list)
    last: deque[float] = attrs.Factory(lambda: deque(maxlen=PAIRED))

    def add(self, rate: float) -> bool:
        """Keep a step's rate; whether it is one of the run's first PAIRED."""
        self.last.append(rate)
        if len(self.first) < PAIRED:
            self.first.append(rate)
            return True
        return False


class SpecThreshold:
    """The step kind of each batch (`kind_for`), and, in auto mode, what the engine's steps
    cost by kind and bucket. Owns the automatic threshold; the engine records its changes."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.is_auto = (
            cfg.is_speculative
            and cfg.speculative_auto_disable
            and cfg.speculative_disable_by_batch_size is None
        )
        self.threshold: int | None = None  # auto: spec while the batch is smaller; None: always
        self.last_kind: str | None = None  # of the step before
        self.steps_since_change = 0  # decode steps counted since the threshold last changed
        self.num_steps: dict[tuple[str, int], int] = {}  # (kind, bucket) -> decode steps run
        self.rates: dict[tuple[str, int], Rate] = {}
        # bucket -> (its counted steps at the next periodic probe, the gap after that probe)
        self.probes: dict[int, tuple[int, int]] = {}
        self.run_of: dict[int, tuple[str, int]] = {}  # bucket -> its counted steps' kind, in a row
        self.runs: dict[int, Run] = {}  # bucket -> its latest run of measured steps of a kind
        # bucket -> spec/no_spec ratios of a run's first steps to the run before it (`_pair`)
        self.pairs: dict[int, deque[float]] = {}
        self.first_gaps: dict[int, int] = {}  # bucket -> its probes' first gap since the change

    def kind_for(self, batch_size: int, is_decode: bool) -> str:
        """`spec` or `no_spec` for a batch; a pure decode batch (`is_decode`) may be a probe."""
        if not self.is_auto:
            return "spec" if self.cfg.spec_enabled_for(batch_size) else "no_spec"
        wanted = self._spec_on(batch_size)
        if is_decode and self._is_probe(bucket_of(batch_size), wanted):
            wanted = not wanted
        return "spec" if wanted else "no_spec"

    def _is_probe(self, bucket: int, wanted: bool) -> bool:
        other = "no_spec" if wanted else "spec"
        if self.num_steps.get((other, bucket), 0) < MIN_SAMPLES:
            return True
        kind, length = self.run_of.get(bucket, ("", 0))
        if other == "spec" and kind == "spec" and length < PAIRED:
            return True  # a spec probe goes on: its first drafts came from a context of one pair
        # a spec probe's first step re-enters the kind, is not counted, and so is probed again
        return self._done(bucket) == self._probes(bucket)[0]

    def _done(self, bucket: int) -> int:
        return self.num_steps.get(("spec", bucket), 0) + self.num_steps.get(("no_spec", bucket), 0)

    def _probes(self, bucket: int) -> tuple[int, int]:
        """The bucket's next periodic probe and the gap after it (`_probe_after`)."""
        return self.probes.get(bucket) or _probe_after(0, self.first_gaps.get(bucket, PROBE_PERIOD))

    def _next_probe(self, bucket: int) -> None:
        """Past the bucket's periodic probe: the next twice as far (at most MAX_PROBE_PERIOD)."""
        at, gap = self._probes(bucket)
        while self._done(bucket) > at:
            gap = min(2 * gap, MAX_PROBE_PERIOD)
            at += gap
        self.probes[bucket] = (at, gap)

    def observe(
        self, kind: str, batch_size: int, is_decode: bool, tokens: int, seconds: float | None
    ) -> None:
        """A step ran: count a pure decode step (`is_decode`) that did not re-enter `spec`, and
        keep its cost when measured (`seconds`; None in a replay)."""
        reentry = kind == "spec" and self.last_kind == "no_spec"
        self.last_kind = kind
        if not (self.is_auto and is_decode) or reentry:
            return
        bucket = bucket_of(batch_size)
        key = (kind, bucket)
        self.num_steps[key] = self.num_steps.get(key, 0) + 1
        kind_before, length = self.run_of.get(bucket, (kind, 0))
        self.run_of[bucket] = (kind, length + 1 if kind_before == kind else 1)
        self._next_probe(bucket)
        self.steps_since_change += 1
        if seconds is not None:
            if seconds > 0:
                self._pair(kind, bucket, tokens / seconds)
            self.rates.setdefault(key, Rate()).add(tokens, seconds)

    def _pair(self, kind: str, bucket: int, rate: float) -> None:
        """Pair a probe (a run of the kind the threshold does not pick, its first PAIRED
        steps) with the last PAIRED steps of the run just before it (spec over no_spec,
        medians): a ratio of steps moments apart, which load changing over time moves little.
        The run back after a probe is not paired: its first spec steps draft from a context
        restarted at the re-entry, and read spec at a loss where it wins 1.5x."""
        run = self.runs.get(bucket)
        if run is None or run.kind != kind:
            run = self.runs[bucket] = Run(kind, before=list(run.last) if run else [])
        is_first = run.add(rate)
        before = statistics.median(run.before) if run.before else 0.0
        is_probe = (kind == "spec") != self._spec_on(bucket)
        if not is_first or before <= 0 or not is_probe:
            return  # a run back to the chosen kind: a spec one drafts from a fresh context
        ratio = statistics.median(run.first) / before
        pairs = self.pairs.setdefault(bucket, deque(maxlen=WINDOW))
        if len(run.first) > 1:
            pairs.pop()  # the run's pair so far, made again of more of its steps
        pairs.append(ratio if kind == "spec" else 1 / ratio)

    @property
    def may_change(self) -> bool:
        """A threshold is kept HOLD_STEPS decode steps, so that noisy rates do not flip it every
        step, unless a bucket's paired verdict against it is decisive (at one stream on 2 busy
        cores, the first windows read EAGLE at 0.61x eight steps in)."""
        return self.steps_since_change >= HOLD_STEPS or self._decisive()

    def _decisive(self) -> bool:
        for bucket in {b for _, b in self.rates}:
            paired = len(self.pairs.get(bucket, ())) >= MIN_SAMPLES
            if not paired and bucket == 1:
                continue  # windows made at other times: no verdict to act on at once
            # windows alone only when far apart: a loaded machine moved them by up to 0.6x
            limit = DECISIVE if paired else DECISIVE_WINDOWS
            ratio = self.ratio(bucket)
            on = self._spec_on(bucket)
            if ratio is not None and (ratio < limit if on else ratio > 1 / limit):
                return True
        return False

    def decide(self) -> int | None:
        """The threshold the measured rates call for: the smallest bucket where `spec` loses
        (with a margin for a bucket where it is off now), None where it loses nowhere."""
        for bucket in sorted({b for _, b in self.rates}):
            ratio = self.ratio(bucket)
            if ratio is None:
                continue
            if ratio < self._floor(bucket):
                return bucket
        return None

    def _floor(self, bucket: int) -> float:
        """The ratio below which spec is (or stays) off in `bucket`. At one stream, on only
        below DECISIVE: a spec step there costs little more than a plain one, so spec loses
        only where nothing is accepted, and an EAGLE probe after spec was off drafts from a
        restarted context (none of 5 drafts accepted at one stream): off on a mild loss, it
        stayed off."""
        if not self._spec_on(bucket):
            return REENABLE_RATIO
        return DECISIVE if bucket == 1 else DISABLE_RATIO

    def ratio(self, bucket: int) -> float | None:
        """spec tok/s over no_spec tok/s in `bucket`: the median of its paired ratios (`_pair`)
        once it has MIN_SAMPLES, else the windows' medians; None until each kind has
        MIN_SAMPLES steps."""
        spec, plain = self.rates.get(("spec", bucket)), self.rates.get(("no_spec", bucket))
        if spec is None or plain is None or min(len(spec.tokens), len(plain.tokens)) < MIN_SAMPLES:
            return None
        pairs = self.pairs.get(bucket, ())
        if len(pairs) >= MIN_SAMPLES:
            return statistics.median(pairs)
        return spec.per_second / plain.per_second if plain.per_second > 0 else None

    def figures(self) -> list[list]:
        """[bucket, spec tok/s, no_spec tok/s] of each bucket judged, for the record."""
        rows = []
        for bucket in sorted({b for _, b in self.rates}):
            if self.ratio(bucket) is not None:
                spec, plain = self.rates[("spec", bucket)], self.rates[("no_spec", bucket)]
                rows.append([bucket, round(spec.per_second, 2), round(plain.per_second, 2)])
        return rows

    def set(self, threshold: int | None, gaps: Sequence[Sequence[int]] = ()) -> None:
        """A new threshold (decided, or a recorded one in a replay); every bucket's probes start
        again, to measure what the change moved: at PROBE_PERIOD, or the first gap `gaps` gives
        the bucket ([[bucket, gap], ...], `probe_gaps`; none in a log written before them)."""
        self.threshold = threshold
        self.steps_since_change = 0
        self.first_gaps = {int(b): int(g) for b, g in gaps}
        buckets = {b for _, b in self.num_steps}
        self.probes = {
            b: _probe_after(self._done(b), self.first_gaps.get(b, PROBE_PERIOD)) for b in buckets
        }

    def _spec_on(self, batch_size: int) -> bool:
        """Whether the threshold has speculation on at `batch_size` (or a bucket's size)."""
        return self.threshold is None or batch_size < self.threshold
