"""Charts of a report, drawn with matplotlib's Agg renderer and returned as PNG `data:` URIs (the page needs no
file beside it and no script). matplotlib is imported on the first chart, never by training's start-up."""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from typing import Any

Series = tuple[Sequence[float], Sequence[float]]
SIZE = (6.4, 3.0)  # inches, at 100 dpi: a chart 640 px wide
MAX_POINTS = 4000
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def line_chart(title: str, series: dict[str, Series], ylabel: str = "", log_y: bool = False) -> str | None:
    """Lines of (x, y) per label over the step; None when no series has a finite point."""
    finite = {k: _finite(xs, ys) for k, (xs, ys) in series.items()}
    finite = {k: v for k, v in finite.items() if v[0]}
    if not finite:
        return None
    figure, axes = _figure(title)
    for n, (label, (xs, ys)) in enumerate(finite.items()):
        marker = "o" if len(xs) <= 20 else None
        axes.plot(xs, ys, label=label, color=COLORS[n % len(COLORS)], marker=marker, markersize=3, linewidth=1.2)
    if log_y and all(y > 0 for _, ys in finite.values() for y in ys):
        axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set_ylabel(ylabel)
    if len(finite) > 1:
        axes.legend(fontsize=8)
    return _data_uri(figure)


def smoothed(values: Sequence[float], weight: float = 0.9) -> list[float]:
    """An exponential moving average with its start-up bias removed (TensorBoard's smoothing)."""
    out, average, count = [], 0.0, 0
    for value in values:
        if math.isfinite(value):
            count += 1
            average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**count) if count else math.nan)
    return out


def setting_chart(title: str, setting: str, points: list[tuple[Any, float, str]]) -> str | None:
    """A metric against one swept setting: one point per job, labelled with its job; numbers on a numeric axis (a
    log one when they span more than a decade), anything else as categories in the jobs' order."""
    points = [(x, y, label) for x, y, label in points if isinstance(y, int | float) and math.isfinite(y)]
    if not points:
        return None
    figure, axes = _figure(title)
    numeric = all(isinstance(x, int | float) and not isinstance(x, bool) for x, _, _ in points)
    if numeric:
        xs = [float(x) for x, _, _ in points]
    else:
        names = list(dict.fromkeys(str(x) for x, _, _ in points))
        xs = [float(names.index(str(x))) for x, _, _ in points]
        axes.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ys = [y for _, y, _ in points]
    axes.scatter(xs, ys, color=COLORS[0], zorder=3)
    for x, y, (_, _, label) in zip(xs, ys, points):
        axes.annotate(f"job {label}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if numeric and min(xs) > 0 and max(xs) > 10 * min(xs):
        axes.set_xscale("log")
    axes.set_xlabel(setting)
    return _data_uri(figure)


def _finite(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    """The finite points, thinned to at most MAX_POINTS (every k-th, the last kept): a chart 640 px wide shows no
    more, and a long run's million steps would take seconds to draw."""
    pairs = [(x, y) for x, y in zip(xs, ys) if isinstance(y, int | float) and math.isfinite(y)]
    if len(pairs) > MAX_POINTS:
        every = math.ceil(len(pairs) / MAX_POINTS)
        pairs = pairs[::every] + ([pairs[-1]] if (len(pairs) - 1) % every else [])
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _figure(title: str) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    figure = Figure(figsize=SIZE, dpi=100)
    # Fixed margins: a layout engine would measure every label first, doubling the time a chart takes to draw.
    figure.subplots_adjust(left=0.11, right=0.98, top=0.9, bottom=0.17)
    axes = figure.add_subplot()
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.tick_params(labelsize=8)
    axes.ticklabel_format(useOffset=False)  # values as they are, not as an offset plus small differences
    return figure, axes


def _data_uri(figure: Any) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)  # the Agg renderer, whatever backend pyplot would choose
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
