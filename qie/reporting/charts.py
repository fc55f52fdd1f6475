"""Charts of a report, written as SVG and returned as `data:` URIs (the page needs no file beside it and no script).

Line charts over the step (with markers on short series, a log scale on request) and one metric against a swept
setting (a numeric axis, log where it spans more than a decade, or categories), 640 x 300 px. Written as text,
without a plotting library: a training process rewrites its report at each checkpoint and at the end, and a
plotting library's import and renderer cost it more memory and time than its whole last step."""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from html import escape
from typing import Any

Series = tuple[Sequence[float], Sequence[float]]
WIDTH, HEIGHT = 640, 300
LEFT, RIGHT, TOP, BOTTOM = 66, 12, 26, 46  # the plot area's margins, px
MAX_POINTS = 4000
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def line_chart(title: str, series: dict[str, Series], ylabel: str = "", log_y: bool = False) -> str | None:
    """Lines of (x, y) per label over the step; None when no series has a finite point."""
    finite = {k: _finite(xs, ys) for k, (xs, ys) in series.items()}
    finite = {k: v for k, v in finite.items() if v[0]}
    if not finite:
        return None
    ys = [y for _, values in finite.values() for y in values]
    log = log_y and all(y > 0 for y in ys)
    x = Axis.of([x for xs, _ in finite.values() for x in xs], False, integer=True)
    y = Axis.of(ys, log)
    parts = _frame(title, x, y, "step", ylabel)
    for n, (xs, values) in enumerate(finite.values()):
        color = COLORS[n % len(COLORS)]
        points = [(x.px(a, LEFT, WIDTH - RIGHT), y.px(b, HEIGHT - BOTTOM, TOP)) for a, b in zip(xs, values)]
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{path}"/>')
        if len(points) <= 20:
            parts += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2.5" fill="{color}"/>' for px, py in points]
    if len(finite) > 1:
        parts += _legend(list(finite))
    return _data_uri(parts)


def setting_chart(title: str, setting: str, points: list[tuple[Any, float, str]]) -> str | None:
    """A metric against one swept setting: one point per job, labelled with its job; numbers on a numeric axis (a
    log one when they span more than a decade), anything else as categories in the jobs' order."""
    points = [(x, y, label) for x, y, label in points if isinstance(y, int | float) and math.isfinite(y)]
    if not points:
        return None
    numeric = all(isinstance(x, int | float) and not isinstance(x, bool) for x, _, _ in points)
    if numeric:
        xs = [float(x) for x, _, _ in points]
        x = Axis.of(xs, min(xs) > 0 and max(xs) > 10 * min(xs))
    else:
        names = list(dict.fromkeys(str(x) for x, _, _ in points))
        xs = [float(names.index(str(x))) for x, _, _ in points]
        x = Axis.categories(names)
    y = Axis.of([y for _, y, _ in points], False)
    parts = _frame(title, x, y, setting, "")
    for a, b, (_, _, label) in zip(xs, (p[1] for p in points), points):
        px, py = x.px(a, LEFT, WIDTH - RIGHT), y.px(b, HEIGHT - BOTTOM, TOP)
        parts.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="{COLORS[0]}"/>')
        parts.append(_text(px + 4, py - 4, f"job {label}", size=9, anchor="start"))
    return _data_uri(parts)


def smoothed(values: Sequence[float], weight: float = 0.9) -> list[float]:
    """An exponential moving average with its start-up bias removed (TensorBoard's smoothing)."""
    out, average, count = [], 0.0, 0
    for value in values:
        if math.isfinite(value):
            count += 1
            average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**count) if count else math.nan)
    return out


class Axis:
    """Where values land on one axis (linear, log or categories) and its ticks with their labels."""

    def __init__(self, low: float, high: float, log: bool, ticks: list[tuple[float, str]]) -> None:
        self.low, self.high, self.log, self.ticks = low, high, log, ticks

    @classmethod
    def of(cls, values: Sequence[float], log: bool, integer: bool = False) -> Axis:
        """An axis over `values`: log with a tick per decade, else about five round ticks."""
        if log:
            low, high = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
            high = max(high, low + 1)
            step = max(1, math.ceil((high - low) / 6))
            return cls(low, high, True, [(10.0**k, _label(10.0**k)) for k in range(low, high + 1, step)])
        low, high = min(values), max(values)
        if high == low:
            low, high = (low - 1, high + 1) if low == 0 else (low - abs(low) * 0.1, high + abs(high) * 0.1)
        step = _round_step((high - low) / 5, integer)
        first = math.floor(low / step) * step
        ticks, tick = [], first
        while tick <= high + step * 0.5:
            ticks.append((tick, _label(tick)))
            tick = first + step * len(ticks)
        return cls(min(low, ticks[0][0]), max(high, ticks[-1][0]), False, ticks)

    @classmethod
    def categories(cls, names: list[str]) -> Axis:
        return cls(-0.5, len(names) - 0.5, False, [(float(i), name) for i, name in enumerate(names)])

    def px(self, value: float, start: float, end: float) -> float:
        """The pixel of `value` between `start` (the axis's low end) and `end`."""
        at = math.log10(value) if self.log else value
        return start + (at - self.low) / (self.high - self.low) * (end - start)


def _frame(title: str, x: Axis, y: Axis, xlabel: str, ylabel: str) -> list[str]:
    """The chart's title, plot area, grid, ticks and axis labels."""
    right, bottom = WIDTH - RIGHT, HEIGHT - BOTTOM
    parts = [f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>', _text(WIDTH / 2, 17, title, 12)]
    for value, label in x.ticks:
        px = x.px(value, LEFT, right)
        parts.append(f'<line x1="{px:.1f}" y1="{TOP}" x2="{px:.1f}" y2="{bottom}" stroke="#ddd"/>')
        parts.append(_text(px, bottom + 14, label, 9))
    for value, label in y.ticks:
        py = y.px(value, bottom, TOP)
        parts.append(f'<line x1="{LEFT}" y1="{py:.1f}" x2="{right}" y2="{py:.1f}" stroke="#ddd"/>')
        parts.append(_text(LEFT - 4, py + 3, label, 9, anchor="end"))
    box = f'x="{LEFT}" y="{TOP}" width="{right - LEFT}" height="{bottom - TOP}"'
    parts.append(f'<rect {box} fill="none" stroke="#444"/>')
    parts.append(_text((LEFT + right) / 2, HEIGHT - 8, xlabel, 10))
    if ylabel:
        parts.append(f'<g transform="translate(12,{(TOP + bottom) / 2:.0f}) rotate(-90)">{_text(0, 0, ylabel, 10)}</g>')
    return parts


def _legend(labels: list[str]) -> list[str]:
    width = 14 + 6 * max(len(label) for label in labels)
    x, y = WIDTH - RIGHT - width - 6, TOP + 6
    parts = [f'<rect x="{x}" y="{y}" width="{width}" height="{14 * len(labels) + 4}" fill="white" stroke="#ccc"/>']
    for n, label in enumerate(labels):
        ly, color = y + 11 + 14 * n, COLORS[n % len(COLORS)]
        line = f'x1="{x + 3}" y1="{ly - 3}" x2="{x + 13}" y2="{ly - 3}"'
        parts.append(f'<line {line} stroke="{color}" stroke-width="2"/>')
        parts.append(_text(x + 16, ly, label, 9, anchor="start"))
    return parts


def _text(x: float, y: float, text: str, size: int, anchor: str = "middle") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-family="sans-serif" font-size="{size}" text-anchor="{anchor}">'
        f"{escape(text)}</text>"
    )


def _round_step(rough: float, integer: bool) -> float:
    """1, 2 or 5 times a power of ten, at least `rough` (at least 1 on an integer axis)."""
    power = 10.0 ** math.floor(math.log10(rough))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= rough)
    return max(step, 1.0) if integer else step


def _label(value: float) -> str:
    return f"{value:.4g}".replace("e-0", "e-").replace("e+0", "e+") if value != 0 else "0"


def _finite(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    """The finite points, thinned to at most MAX_POINTS (every k-th, the last kept): a chart 640 px wide shows no
    more, and a long run's million steps would make a page of megabytes."""
    pairs = [
        (x, y)
        for x, y in zip(xs, ys)
        if isinstance(x, int | float) and isinstance(y, int | float) and math.isfinite(y) and math.isfinite(x)
    ]
    if len(pairs) > MAX_POINTS:
        every = math.ceil(len(pairs) / MAX_POINTS)
        pairs = pairs[::every] + ([pairs[-1]] if (len(pairs) - 1) % every else [])
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _data_uri(parts: list[str]) -> str:
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}">{"".join(parts)}</svg>'
    )
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode("utf-8")).decode("ascii")
