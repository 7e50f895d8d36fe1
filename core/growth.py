"""The rule that tells a leak from a high-water mark in one memory figure, from its values alone.

A fixed byte tolerance is wrong both ways: a step up under a burst (a new largest batch, a long
prompt, a library's first use of a shape) passes any small tolerance and then stays flat, while a
slow slope hides under any large one for hours.  So a figure is judged by its shape over the
work done, not by its size:

* its floor (the least value) is taken over windows of `window` steps, after `warmup_windows`
  windows; what lives and dies within a step never moves a floor;
* a window whose floor is more than `noise` over the highest floor so far is a *rise*; where
  memory is cached by shape (`shapes_explain`), a rise in a window that ran a step larger than
  any before (more rows or more fed tokens) is explained by that work's shape and is a
  high-water mark, not growth with the work;
* `rises` unexplained rises, each coming before the figure has been flat for `patience` times
  their spacing (at least `min_flat` windows), are a *slope*: reported with its rate per step,
  per request and per token since the baseline and a projection to `capacity`; the next report
  of the same slope waits for the growth to double;
* a figure flat for that long after rising has reached a *plateau*: reported once, as
  information, and the rises counted so far are forgotten.

Judged from the values and the step plans' work only (no clock), so that a replay of recorded
traffic judges every device figure the same way.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class GrowthRule:
    window: int = 8  # steps whose least value is one floor
    rises: int = 3  # unexplained rises that make a slope
    noise: int = 0  # bytes (or counts) a floor may move without it being a rise
    warmup_windows: int = 1  # windows after the first serving step that set the baseline
    min_flat: int = 16  # flat windows that end a run of rises (a single rise's spacing)
    patience: int = 3  # flat for this many spacings of the rises so far ends their run
    # a rise under a new largest step is a high-water mark: true of what caches by shape (the
    # allocator's reserved memory, a process's resident memory), never of live bytes, which a
    # step gives back whatever its shape
    shapes_explain: bool = True


@attrs.frozen
class StepWork:
    """What one step did: its rows and fed tokens (its shape) and the requests it admitted."""

    rows: int
    tokens: int
    admitted: int


@attrs.frozen
class Mark:
    """A window's start (step, and the requests and tokens done before it) and its floor."""

    step: int
    requests: int
    tokens: int
    floor: int = 0


@attrs.frozen
class Slope:
    base: Mark  # the baseline
    first: Mark  # the window of the first counted rise
    last: Mark  # the window of the last: the rate is measured between these two

    @property
    def begin_step(self) -> int:
        return self.first.step

    @property
    def growth(self) -> int:
        return self.last.floor - self.base.floor

    @property
    def per_step(self) -> float:
        return (self.last.floor - self.first.floor) / max(self.last.step - self.first.step, 1)

    def rate(self, unit: str = "B") -> str:
        grew = self.last.floor - self.first.floor
        per = [f"{self.per_step:,.0f} {unit}/step"]
        if self.last.requests > self.first.requests:
            per.append(f"{grew / (self.last.requests - self.first.requests):,.0f} {unit}/request")
        if self.last.tokens > self.first.tokens:
            per.append(f"{grew / (self.last.tokens - self.first.tokens):,.1f} {unit}/token")
        return ", ".join(per)

    def steps_to(self, capacity: int) -> int | None:
        """Steps until the figure reaches `capacity` at this rate (None: no capacity known)."""
        if capacity <= 0:
            return None
        if capacity <= self.last.floor or self.per_step <= 0:
            return 0
        return int((capacity - self.last.floor) / self.per_step)


@attrs.frozen
class Plateau:
    step: int  # the window where the last rise began
    base: int
    level: int
    flat_steps: int


KEPT_LEVELS = 1024  # windows whose level FloorWatch.level_at can tell


class FloorWatch:
    """One figure's floors, window by window, judged by `rule` (see the module's docstring)."""

    def __init__(self, rule: GrowthRule):
        self.rule = rule
        self._values: list[int] = []
        self._start = Mark(0, 0, 0)
        self._peak = (0, 0)  # the largest rows and tokens of a step so far
        self._new_peak = False
        self._warmup = rule.warmup_windows
        self._base: Mark | None = None
        self._requests = self._tokens = 0
        self.level = 0
        self._rises: list[tuple[int, Mark]] = []  # (window index, its start and floor)
        self.levels: dict[int, int] = {}  # a window's start step -> the level after it
        self._windows = 0
        self._last_rise = -1  # window index; -1: none since the last plateau
        self._next_report = 1
        self.plateau_reported = False

    def observe(self, step: int, value: int, work: StepWork) -> Slope | Plateau | None:
        if not self._values:
            self._start = Mark(step, self._requests, self._tokens)
        self._values.append(value)
        self._requests += work.admitted
        self._tokens += work.tokens
        if work.rows > self._peak[0] or work.tokens > self._peak[1]:
            self._new_peak = self._base is not None  # the warm-up's shapes set the first peak
            self._peak = (max(self._peak[0], work.rows), max(self._peak[1], work.tokens))
        if len(self._values) < self.rule.window:
            return None
        mark = attrs.evolve(self._start, floor=min(self._values))
        new_peak, self._values, self._new_peak = self._new_peak, [], False
        return self._judge(step, mark, new_peak)

    def _judge(self, step: int, mark: Mark, new_peak: bool) -> Slope | Plateau | None:
        self._windows += 1
        self._keep_level(mark.step, max(self.level, mark.floor))
        if self._base is None:
            self._warmup -= 1
            if self._warmup <= 0:
                self._base, self.level = mark, mark.floor
            return None
        if mark.floor > self.level + self.rule.noise:
            self.level, self._last_rise = mark.floor, self._windows
            if not (new_peak and self.rule.shapes_explain):
                self._rises.append((self._windows, mark))
                return self._slope()
            return None
        return self._plateau(step)

    def _keep_level(self, step: int, level: int) -> None:
        self.levels[step] = level
        if len(self.levels) > KEPT_LEVELS:
            del self.levels[next(iter(self.levels))]

    def level_at(self, step: int) -> int:
        """The level after the window that started at `step` (the oldest kept if gone)."""
        return self.levels.get(step, next(iter(self.levels.values()), self.level))

    def _slope(self) -> Slope | None:
        base = self._base
        assert base is not None
        if len(self._rises) < self.rule.rises or self.level - base.floor < self._next_report:
            return None
        self._next_report = 2 * (self.level - base.floor)
        first, last = self._rises[0][1], self._rises[-1][1]
        self._rises = []
        return Slope(base, first, last)

    def _flat_limit(self) -> int:
        rises = self._rises
        if len(rises) < 2:
            return self.rule.min_flat
        spacing = (rises[-1][0] - rises[0][0]) / (len(rises) - 1)
        return max(self.rule.min_flat, int(self.rule.patience * spacing))

    def _plateau(self, step: int) -> Plateau | None:
        if self._last_rise < 0:
            return None
        flat = self._windows - self._last_rise
        if flat < self._flat_limit():
            return None
        self._rises, self._last_rise = [], -1
        if self.plateau_reported:
            return None
        self.plateau_reported = True
        base = self._base.floor if self._base is not None else self.level
        return Plateau(step, base, self.level, flat * self.rule.window)
