"""`memstep plot` of a served run, checked from the figure's objects: the model's name in the
title, legends outside the data, every series in a legend, every axis labelled and starting at
zero, a flat-zero series left out, kind shading only for the kinds that change, the format
from the file's extension.  Each check is also shown failing on a figure made to break it."""

from __future__ import annotations

import matplotlib.image
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from replay_helpers import memstep

from memstep.events.types import StepFinished
from memstep.replay.recording import load
from memstep.replay.timeline import KIND_COLORS, memory_figure, model_name


@pytest.fixture(scope="module")
def served_fig(served_run) -> Figure:
    fig = memory_figure(load(served_run.log))
    fig.canvas.draw()  # lay out, so that extents are final
    return fig


def legends_outside(fig: Figure) -> bool:
    """Every legend lies right of the data area of every panel (no line can be under one)."""
    data = [ax.get_window_extent() for ax in fig.axes]
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    return bool(legends) and all(
        leg.get_window_extent().x0 >= box.x1 - 1 for leg in legends for box in data
    )


def unlabelled_series(fig: Figure) -> list[str]:
    """Lines with data that no legend names."""
    named = {t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().texts}
    lines = [line for ax in fig.axes for line in ax.get_lines() if len(line.get_xdata()) > 1]
    return [line.get_label() for line in lines if line.get_label() not in named]


def axes_below_zero(fig: Figure) -> list[str]:
    return [ax.get_ylabel() for ax in fig.axes if ax.get_ylim()[0] < 0]


def shaded_colors(fig: Figure) -> set[str]:
    return {
        matplotlib.colors.to_hex(c.get_facecolor()[0])
        for ax in fig.axes
        for c in ax.collections
        if isinstance(c, PolyCollection) and len(c.get_paths())
    }


def broken_figure(legend_inside: bool = True, label: str = "_nolegend_") -> Figure:
    fig = Figure()
    ax = fig.subplots()
    ax.plot([0, 1, 2], [0, 0, 0], label="flat")
    ax.plot([0, 1, 2], [1, 2, 3], label=label)
    ax.legend(loc="upper left") if legend_inside else None
    fig.canvas.draw()
    return fig


def test_the_title_names_the_model_not_its_hash(served_run, served_fig):
    title = served_fig.get_suptitle()
    assert "random:tiny (random weights)" in title
    assert load(served_run.log).model_identity not in title  # random:tiny:seed=0
    assert model_name({"model": "smollm2"}) == "SmolLM2-135M-Instruct.Q4_1"
    assert model_name({"model": "/models/Llama-3.2-1B"}) == "Llama-3.2-1B"


def test_legends_stand_outside_the_data(served_fig):
    assert legends_outside(served_fig)
    assert not legends_outside(broken_figure())


def test_every_series_is_labelled_in_a_legend(served_fig):
    assert unlabelled_series(served_fig) == []
    named = {
        t.get_text() for ax in served_fig.axes if ax.get_legend() for t in ax.get_legend().texts
    }
    assert {"KV pages in use", "KV pages cached", "executor RSS (right axis)"} <= named
    fig = broken_figure(legend_inside=False)
    fig.axes[0].legend(loc="upper left", bbox_to_anchor=(1.05, 1))
    assert unlabelled_series(fig) == ["_nolegend_"]


def test_every_axis_is_labelled_with_rss_on_the_top_panel(served_fig):
    labels = [ax.get_ylabel() for ax in served_fig.axes]
    assert labels[0] == "live / reserved (MiB)" and labels[2:4] == ["KV pages", "host RSS (MiB)"]
    assert labels[1].startswith("growth since step ") and labels[4].startswith("host growth (")


def test_a_flat_zero_series_is_dropped_and_no_axis_goes_below_zero(served_fig):
    # a growth axis goes below zero only as far as a figure fell below its first value
    assert [label for label in axes_below_zero(served_fig) if "growth" not in label] == []
    for ax in served_fig.axes:
        lows = [min(line.get_ydata(), default=0) for line in ax.get_lines()]
        if "growth" in ax.get_ylabel():
            assert ax.get_ylim()[0] >= min([0.0, *lows]) * 1.08 - 1e-9
    named = {
        t.get_text() for ax in served_fig.axes if ax.get_legend() for t in ax.get_legend().texts
    }
    assert "arena claimed: 0 B at every step" in named
    assert not any("arena" in ax.get_ylabel() for ax in served_fig.axes)
    assert axes_below_zero(broken_figure()) == [""]  # matplotlib's own -0.055..0.055 for a 0 line


def test_kinds_are_shaded_only_where_they_change(served_fig, tiny_log):
    assert shaded_colors(served_fig) == set()  # every step no_spec: nothing to shade
    texts = [t.get_text() for t in served_fig.axes[0].get_legend().texts]
    assert "no_spec steps (unshaded)" in texts
    steps = [r for r in load(tiny_log.path).records if isinstance(r, StepFinished)]
    kinds = {k: sum(s.kind == k for s in steps) for k in ("spec", "no_spec")}
    background = max(kinds, key=lambda k: kinds[k])
    shaded = shaded_colors(memory_figure(load(tiny_log.path)))
    other = "spec" if background == "no_spec" else "no_spec"
    assert min(kinds.values()) > 0 and shaded == {KIND_COLORS[other]}


@pytest.mark.parametrize(
    ("suffix", "magic"), [("png", b"\x89PNG"), ("svg", b"<?xml"), ("pdf", b"%PDF")]
)
def test_the_format_follows_the_file_s_extension(served_run, tmp_path, suffix, magic):
    out = tmp_path / f"mem.{suffix}"
    code, said, err = memstep("plot", str(served_run.log), "-o", str(out))
    assert code == 0 and said.strip() == f"wrote {out}", err
    assert out.read_bytes().startswith(magic)


def test_an_unknown_extension_is_refused(served_run, tmp_path):
    code, _, err = memstep("plot", str(served_run.log), "-o", str(tmp_path / "mem.jpg"))
    assert code == 2 and "name a .png, .svg or .pdf file" in err
    assert not (tmp_path / "mem.jpg").exists()
