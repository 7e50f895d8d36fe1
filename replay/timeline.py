"""The memory timeline of a log as a figure (PNG, SVG or PDF, by the file's extension): what every
step left alive, with the step kinds behind.

Top panel: live and reserved bytes after each step, and each process's resident host memory,
leak reports marked.  Middle panel: what each figure grew by since the first step, on an axis
scaled to the growth (a leak of a few MiB is flat on the top panel's hundreds), each leak report
labelled with its kind and size.  Bottom panel: KV pages in use and pages cached for prefix
reuse, and the bytes the arena ledger says are claimed by step kinds (right axis; left out when
it is zero throughout, and said so in the legend), with what the start-up kinds (warmup,
capture) claimed and released before the first step.  Steps of the run's most common kind are
the background; the steps of any other kind are shaded, with a dotted line at every transition
between kinds; a lost executor is a solid dark red line, labelled with its recovery time.
Legends stand outside the panels, so no line is hidden under one.  The title names the model as
the run was given it and carries the prefix-cache hit rate.  Rendered with matplotlib's Figure
(no display, no global backend switch).
"""

from __future__ import annotations

import errno
import os
import textwrap
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from memstep.core.model_source import ALIASES, DEFAULT_GGUF
from memstep.events.types import ExecutorLost, LeakSuspected, RecoveryDone, StepFinished, is_leak
from memstep.replay.recording import Recording
from memstep.replay.summary import summarize
from memstep.replay.text_table import fmt_bytes

KIND_COLORS = {"no_spec": "#d6e4f0", "spec": "#fbd9b5"}
STARTUP_KINDS = ("warmup", "capture")
OTHER_COLORS = ("#dcedc8", "#e1bee7", "#fff9c4")
LOSS_COLOR = "#8b0000"
MIB = 1 << 20
STEPS = "steps-mid"  # each figure holds for its whole step
FORMATS = ("png", "svg", "pdf")
OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.06, 1.0), "fontsize": 8, "borderaxespad": 0}


def plot_memory(recording: Recording, output: str | Path) -> Path:
    """Draw the memory timeline of `recording` into `output`, in the format its extension names
    (png, svg or pdf); returns its path."""
    path = Path(output)
    fmt = path.suffix.lower().lstrip(".")
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if fmt not in FORMATS:
        raise ValueError(f"{path}: name a .png, .svg or .pdf file (the format follows it)")
    memory_figure(recording).savefig(path, format=fmt)
    return path


def memory_figure(recording: Recording) -> Figure:
    steps = [r for r in recording.records if isinstance(r, StepFinished)]
    if not steps:
        raise ValueError(f"{recording.path}: no steps recorded, nothing to plot")
    fig = Figure(figsize=(12, 9), dpi=100, layout="constrained")
    top, middle, bottom = fig.subplots(3, 1, sharex=True, height_ratios=[3, 2, 2])
    x = [s.step for s in steps]
    mem = [s.memory for s in steps]
    top_handles = _top(top, x, mem)
    kinds, changes = _shade(fig, (top, middle, bottom), steps)
    leaks = [r for r in recording.records if is_leak(r)]
    for leak in leaks:
        top.axvline(leak.step, color="red", lw=1.2, alpha=0.8)
    middle_handles = _growth(middle, x, mem, leaks)
    middle.legend(handles=middle_handles, **OUTSIDE)
    bottom_handles = _bottom(bottom, x, mem) + _startup(recording.records)
    bottom.set_xlabel("step")
    losses = _losses(top, recording.records)
    handles = top_handles + _legend(kinds, bool(changes), bool(leaks))
    if losses:
        handles.append(Line2D([], [], color=LOSS_COLOR, label="executor lost"))
    top.legend(handles=handles, **OUTSIDE)
    bottom.legend(handles=bottom_handles, **OUTSIDE)
    fig.suptitle(_title(recording, steps), fontsize=10)
    return fig


def _top(ax: Axes, x: list[int], mem: list) -> list:
    """Live and reserved bytes on the left axis; each process's host RSS on the right one (its
    hundreds of MiB would flatten a small model's live bytes on one axis)."""
    ax.plot(x, [m.live_bytes / MIB for m in mem], color="C0", lw=1.6, label="live", ds=STEPS)
    reserved = [m.reserved_bytes / MIB for m in mem]
    ax.plot(x, reserved, color="C1", lw=1.0, ls="--", label="reserved", ds=STEPS)
    ax.set_ylabel("live / reserved (MiB)")
    _floor(ax)
    handles = list(ax.get_legend_handles_labels()[0])
    rss = {p: [getattr(m, f"{p}_rss_bytes") / MIB for m in mem] for p in ("executor", "core")}
    if any(any(v) for v in rss.values()):
        right = ax.twinx()
        for color, (process, values) in zip(("C5", "C6"), rss.items(), strict=True):
            if any(values):
                label = f"{process} RSS (right axis)"
                right.plot(x, values, color=color, lw=1.0, ls="-.", label=label, ds=STEPS)
        right.set_ylabel("host RSS (MiB)")
        _floor(right)
        handles += right.get_legend_handles_labels()[0]
    return handles


def _growth(ax: Axes, x: list[int], mem: list, leaks: list[LeakSuspected]) -> list:
    """What each figure grew by since the first step, on an axis of its own scale: a leak of a
    few MiB is flat on the top panel's hundreds.  Device figures on the left, host memory on
    the right; each leak report marked with its kind and size, labels stepped apart."""
    live, reserved = (
        _since_first([m.live_bytes for m in mem]),
        _since_first([m.reserved_bytes for m in mem]),
    )
    unit, scale = _unit(max(map(abs, live + reserved), default=0))
    ax.plot(x, [v / scale for v in live], color="C0", lw=1.6, ds=STEPS, label="live growth")
    label = "reserved growth"
    ax.plot(x, [v / scale for v in reserved], color="C1", lw=1.0, ls="--", ds=STEPS, label=label)
    ax.set_ylabel(f"growth since step {x[0]} ({unit})")
    _span(ax)
    _marks(ax, leaks, dict(zip(x, live, strict=True)), scale)
    handles = list(ax.get_legend_handles_labels()[0])
    rss = _since_first([m.executor_rss_bytes for m in mem])
    if any(m.executor_rss_bytes for m in mem):
        right = ax.twinx()
        host_unit, host_scale = _unit(max(map(abs, rss), default=0))
        label = "executor RSS growth (right axis)"
        values = [v / host_scale for v in rss]
        right.plot(x, values, color="C5", lw=1.0, ls="-.", ds=STEPS, label=label)
        right.set_ylabel(f"host growth ({host_unit})")
        _span(right)
        handles += right.get_legend_handles_labels()[0]
    return handles


def _span(ax: Axes) -> None:
    """From zero (or the least growth, where a figure fell) to the most, with a margin; a series
    flat at zero gets 0..1."""
    data = [np.asarray(line.get_ydata(), dtype=float) for line in ax.get_lines()]
    low = min((float(np.min(d, initial=0)) for d in data), default=0.0)
    high = max((float(np.max(d, initial=0)) for d in data), default=0.0)
    ax.set_ylim(min(low, 0.0) * 1.08, high * 1.08 if high > 0 else 1)
    ax.ticklabel_format(axis="y", useOffset=False)


def _since_first(values: list[int]) -> list[int]:
    return [v - values[0] for v in values]


def _unit(peak: int) -> tuple[str, int]:
    """The unit a growth of `peak` bytes reads best in."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if peak >= 2 * scale:
            return unit, scale
    return "B", 1


def _marks(ax: Axes, leaks: list[LeakSuspected], grew_at: dict, scale: int) -> None:
    """A marker and a label at each leak report: its kind and size, the labels stepped up and
    down in turn so that reports close together do not write over each other."""
    for i, leak in enumerate(leaks):
        ax.axvline(leak.step, color="red", lw=1.2, alpha=0.8)
        y = grew_at.get(leak.step, 0) / scale
        ax.plot([leak.step], [y], marker="v", color="red", ms=9, label="_leak")
        text = f"{leak.what} {fmt_bytes(leak.nbytes)}"
        box = {"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8}
        offset = (6, 8 + 14 * (i % 4))
        ax.annotate(
            text,
            (leak.step, y),
            xytext=offset,
            textcoords="offset points",
            color="red",
            fontsize=8,
            bbox=box,
        )


def _bottom(ax: Axes, x: list[int], mem: list) -> list:
    """KV pages on the left axis, arena claimed on the right one unless flat at zero."""
    used = [m.kv_pages_used for m in mem]
    cached = [m.kv_pages_cached for m in mem]
    ax.plot(x, used, color="C3", lw=1.0, ds=STEPS, label="KV pages in use")
    ax.plot(x, cached, color="C4", lw=1.0, ls="--", ds=STEPS, label="KV pages cached")
    ax.set_ylabel("KV pages")
    _floor(ax)
    handles = list(ax.get_legend_handles_labels()[0])
    arena = [m.arena_claimed_bytes / MIB for m in mem]
    if any(arena):
        right = ax.twinx()
        right.plot(x, arena, color="C2", lw=1.4, ds=STEPS, label="arena claimed (right axis)")
        right.set_ylabel("arena claimed (MiB)")
        _floor(right)
        handles += right.get_legend_handles_labels()[0]
    else:
        handles.append(Line2D([], [], color="none", label="arena claimed: 0 B at every step"))
    return handles


def _floor(ax: Axes) -> None:
    """Start the axis at zero; a series flat at zero gets 0..1, not matplotlib's -0.04..0.04."""
    top = max((float(np.max(line.get_ydata(), initial=0)) for line in ax.get_lines()), default=0)
    ax.set_ylim(0, top * 1.08 if top > 0 else 1)
    ax.ticklabel_format(axis="y", useOffset=False)


def _shade(fig: Figure, axes: tuple[Axes, ...], steps: list[StepFinished]) -> tuple[list, list]:
    """Shade the steps of every kind but the most common one, and mark each transition."""
    counts: dict[str, int] = {}
    for s in steps:
        counts[s.kind] = counts.get(s.kind, 0) + 1
    background = max(counts, key=lambda k: counts[k])
    colors = _colors(list(counts))
    shaded = {k: c for k, c in colors.items() if k != background}
    changes = [b.step for a, b in zip(steps, steps[1:], strict=False) if a.kind != b.kind]
    for ax in axes:
        _bands(ax, steps, shaded)
        ax.vlines(
            [c - 0.5 for c in changes],
            0,
            1,
            transform=ax.get_xaxis_transform(),
            colors="0.35",
            linestyles=":",
            lw=0.8,
        )
    return [(k, shaded.get(k)) for k in counts], changes


def _colors(kinds: list[str]) -> dict[str, str]:
    others = iter(OTHER_COLORS * (len(kinds) // len(OTHER_COLORS) + 1))
    return {k: KIND_COLORS.get(k) or next(others) for k in kinds}


def _bands(ax: Axes, steps: list[StepFinished], colors: dict[str, str]) -> None:
    """Shade each step, [step - 0.5, step + 0.5], in its kind's colour; one artist per kind."""
    edges = [e for s in steps for e in (s.step - 0.5, s.step + 0.5)]
    for kind, color in colors.items():
        where = [s.kind == kind for s in steps for _ in (0, 1)]
        ax.fill_between(
            edges,
            0,
            1,
            where=where,
            transform=ax.get_xaxis_transform(),
            color=color,
            lw=0,
            zorder=0,
        )


def _startup(records: list[object]) -> list:
    """What each start-up kind claimed and released before step 0, as legend lines."""
    ledger = summarize(records).ledger
    return [
        Line2D(
            [],
            [],
            color="none",
            label=f"before step 0, {kind}: claimed "
            f"{fmt_bytes(k.claimed)}, released {fmt_bytes(k.released)}",
        )
        for kind, k in ledger.items()
        if kind in STARTUP_KINDS
    ]


def _losses(ax: Axes, records: list[object]) -> int:
    """A line at each lost executor, labelled with how long its recovery took."""
    took = {r.step: r.seconds for r in records if isinstance(r, RecoveryDone)}
    losses = [r for r in records if isinstance(r, ExecutorLost)]
    for loss in losses:
        ax.axvline(loss.step - 0.5, color=LOSS_COLOR, lw=1.4, label="executor lost")
        label = f"recovered in {took.get(loss.step, 0):.1f} s"
        if loss.gave_up or loss.during not in ("idle", "step"):
            label = "gave up" if loss.gave_up else f"restart died in {loss.during}"
        ax.annotate(
            label,
            (loss.step - 0.5, 0.95),
            xycoords=("data", "axes fraction"),
            xytext=(4, 0),
            textcoords="offset points",
            color=LOSS_COLOR,
            fontsize=8,
        )
    return len(losses)


def _legend(kinds: list, transitions: bool, leaks: bool) -> list:
    """Each kind (unshaded: the background), transitions, leaks."""
    handles: list = []
    for kind, color in kinds:
        label = f"{kind} steps" if color else f"{kind} steps (unshaded)"
        handles.append(Patch(facecolor=color or "white", edgecolor="0.6", label=label))
    if transitions:
        handles.append(Line2D([], [], color="0.35", ls=":", label="transition"))
    if leaks:
        handles.append(Line2D([], [], color="red", marker="v", label="leak suspected"))
    return handles


def _title(recording: Recording, steps: list[StepFinished]) -> str:
    s = summarize(recording.records)
    damaged = " (damaged log: intact records only)" if recording.problems else ""
    return (
        f"memstep memory timeline: {model_name(recording.config)}, steps {steps[0].step}"
        f"..{steps[-1].step}, {len(s.transitions)} transitions, {len(s.leaks)} leak reports"
        f"{_hit_rate(s.requests.prefix_hit_rate)}{damaged}\n"
        + "\n".join(textwrap.wrap(recording.highlights(), 140))
    )


def model_name(config: dict) -> str:
    """The model as people name it: the shipped GGUF's name for its aliases, a file's or a
    folder's name, or the random preset (marked as random)."""
    spec = str(config.get("model", "?"))
    if spec in ALIASES:
        return Path(DEFAULT_GGUF).stem
    if spec.startswith("random:"):
        return f"{spec} (random weights)"
    return Path(spec).name or spec


def _hit_rate(rate: float | None) -> str:
    return "" if rate is None else f", prefix-cache hit rate {rate:.1%}"
