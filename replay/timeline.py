"""The memory timeline of a log as a PNG: what every step left alive, with the step kinds behind.

Top panel: live and reserved bytes after each step, and each process's resident host memory,
leak reports marked.  Bottom panel: bytes the arena ledger says are claimed by step kinds, with
what the start-up kinds (warmup, capture) claimed and released before the first step, and KV
pages in use and pages cached for prefix reuse (right axis); the title carries the prefix-cache
hit rate.  Both panels shade each step by
its kind and draw a dotted line at every transition between kinds; a lost executor is a solid
dark red line, labelled with its recovery time.
Rendered with matplotlib's Agg canvas (no display, no global backend switch).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from memstep.events.types import ExecutorLost, LeakSuspected, RecoveryDone, StepFinished
from memstep.replay.recording import Recording
from memstep.replay.summary import summarize
from memstep.replay.text_table import fmt_bytes

KIND_COLORS = {"no_spec": "#d6e4f0", "spec": "#fbd9b5"}
STARTUP_KINDS = ("warmup", "capture")
OTHER_COLORS = ("#dcedc8", "#e1bee7", "#fff9c4")
LOSS_COLOR = "#8b0000"
MIB = 1 << 20
STEPS = "steps-mid"  # each figure holds for its whole step


def plot_memory(recording: Recording, output: str | Path) -> Path:
    """Draw the memory timeline of `recording` into the PNG file `output`; returns its path."""
    steps = [r for r in recording.records if isinstance(r, StepFinished)]
    if not steps:
        raise ValueError(f"{recording.path}: no steps recorded, nothing to plot")
    fig = Figure(figsize=(12, 7), dpi=100, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    x = [s.step for s in steps]
    mem = [s.memory for s in steps]
    top.plot(x, [m.live_bytes / MIB for m in mem], color="C0", lw=1.6, label="live", ds=STEPS)
    reserved = [m.reserved_bytes / MIB for m in mem]
    top.plot(x, reserved, color="C1", lw=1.0, ls="--", label="reserved", ds=STEPS)
    for color, process in (("C5", "executor"), ("C6", "core")):
        rss = [getattr(m, f"{process}_rss_bytes") / MIB for m in mem]
        if any(rss):
            top.plot(x, rss, color=color, lw=1.0, ls="-.", label=f"{process} RSS", ds=STEPS)
    bottom.plot(x, [m.arena_claimed_bytes / MIB for m in mem], color="C2", lw=1.4, ds=STEPS)
    pages = bottom.twinx()
    pages.plot(x, [m.kv_pages_used for m in mem], color="C3", lw=1.0, alpha=0.8, ds=STEPS)
    cached = [m.kv_pages_cached for m in mem]
    pages.plot(x, cached, color="C4", lw=1.0, ls="--", alpha=0.8, ds=STEPS)
    pages.set_ylabel("KV pages: in use (solid), cached (dashed)")
    kinds = list(dict.fromkeys(s.kind for s in steps))
    colors = _colors(kinds)
    changes = [b.step for a, b in zip(steps, steps[1:], strict=False) if a.kind != b.kind]
    for ax in (top, bottom):
        _bands(ax, steps, colors)
        ax.vlines(
            [c - 0.5 for c in changes], 0, 1, transform=ax.get_xaxis_transform(),
            colors="0.35", linestyles=":", lw=0.8,
        )  # fmt: skip
        ax.ticklabel_format(axis="y", useOffset=False)
    leaks = [r for r in recording.records if isinstance(r, LeakSuspected)]
    _leaks(top, leaks, dict(zip(x, mem, strict=True)))
    top.set_ylabel("live / reserved (MiB)")
    bottom.set_ylabel("arena claimed (MiB)")
    _startup(bottom, recording.records)
    bottom.set_xlabel("step")
    losses = _losses(top, recording.records)
    handles = _legend(top, kinds, colors, bool(changes), bool(leaks))
    if losses:
        handles.append(Line2D([], [], color=LOSS_COLOR, label="executor lost"))
    top.legend(handles=handles, loc="upper left", fontsize=8, ncols=3)
    bottom.legend(
        handles=[Line2D([], [], color="C2", label="arena claimed"),
                 Line2D([], [], color="C3", label="KV pages in use (right axis)")],
        loc="upper left", fontsize=8,
    )  # fmt: skip
    fig.suptitle(_title(recording, steps), fontsize=10)
    path = Path(output)
    fig.savefig(path, format="png")  # never a name of matplotlib's: `-o DIR` is not DIR.png
    return path


def _colors(kinds: list[str]) -> dict[str, str]:
    others = iter(OTHER_COLORS * (len(kinds) // len(OTHER_COLORS) + 1))
    return {k: KIND_COLORS.get(k) or next(others) for k in kinds}


def _bands(ax: Axes, steps: list[StepFinished], colors: dict[str, str]) -> None:
    """Shade each step, [step - 0.5, step + 0.5], in its kind's colour; one artist per kind."""
    edges = [e for s in steps for e in (s.step - 0.5, s.step + 0.5)]
    for kind, color in colors.items():
        where = [s.kind == kind for s in steps for _ in (0, 1)]
        ax.fill_between(
            edges, 0, 1, where=where, transform=ax.get_xaxis_transform(),
            color=color, lw=0, zorder=0,
        )  # fmt: skip


def _leaks(ax: Axes, leaks: list[LeakSuspected], mem_at: dict) -> None:
    for leak in leaks:
        ax.axvline(leak.step, color="red", lw=1.2, alpha=0.8)
        m = mem_at.get(leak.step)
        y = m.live_bytes / MIB if m is not None else ax.get_ylim()[1]
        ax.plot([leak.step], [y], marker="v", color="red", ms=9)
        ax.annotate(
            f"leak: {leak.kind} {leak.what}", (leak.step, y), xytext=(6, 6),
            textcoords="offset points", color="red", fontsize=8,
        )  # fmt: skip


def _startup(ax: Axes, records: list[object]) -> None:
    """What each start-up kind claimed and released, in a corner: they run before step 0."""
    ledger = summarize(records).ledger
    lines = [
        f"{kind}: claimed {fmt_bytes(k.claimed)}, released {fmt_bytes(k.released)}"
        for kind, k in ledger.items()
        if kind in STARTUP_KINDS
    ]
    if lines:
        ax.annotate(
            "before step 0:\n" + "\n".join(lines), (0.99, 0.95), xycoords="axes fraction",
            ha="right", va="top", fontsize=8, color="0.25",
        )  # fmt: skip


def _losses(ax: Axes, records: list[object]) -> int:
    """A line at each lost executor, labelled with how long its recovery took."""
    took = {r.step: r.seconds for r in records if isinstance(r, RecoveryDone)}
    losses = [r for r in records if isinstance(r, ExecutorLost)]
    for loss in losses:
        ax.axvline(loss.step - 0.5, color=LOSS_COLOR, lw=1.4)
        label = f"recovered in {took.get(loss.step, 0):.1f} s"
        if loss.gave_up or loss.during not in ("idle", "step"):
            label = "gave up" if loss.gave_up else f"restart died in {loss.during}"
        ax.annotate(
            label, (loss.step - 0.5, 0.95), xycoords=("data", "axes fraction"),
            xytext=(4, 0), textcoords="offset points", color=LOSS_COLOR, fontsize=8,
        )  # fmt: skip
    return len(losses)


def _legend(
    ax: Axes, kinds: list[str], colors: dict[str, str], transitions: bool, leaks: bool
) -> list:
    handles = list(ax.get_legend_handles_labels()[0])
    handles += [Patch(color=colors[k], label=f"{k} steps") for k in kinds]
    if transitions:
        handles.append(Line2D([], [], color="0.35", ls=":", label="transition"))
    if leaks:
        handles.append(Line2D([], [], color="red", marker="v", label="leak suspected"))
    return handles


def _title(recording: Recording, steps: list[StepFinished]) -> str:
    s = summarize(recording.records)
    damaged = " (damaged log: intact records only)" if recording.problems else ""
    return (
        f"memstep memory timeline: {recording.model_identity}, steps {steps[0].step}"
        f"..{steps[-1].step}, {len(s.transitions)} transitions, {len(s.leaks)} leak reports"
        f"{_hit_rate(s.requests.prefix_hit_rate)}{damaged}\n"
        + "\n".join(textwrap.wrap(recording.highlights(), 140))
    )


def _hit_rate(rate: float | None) -> str:
    return "" if rate is None else f", prefix-cache hit rate {rate:.1%}"
