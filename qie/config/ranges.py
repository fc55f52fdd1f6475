"""The range check of the schemas' own `problem()` methods: one line naming the key, its value and the bounds."""

from __future__ import annotations

from collections.abc import Iterable


def out_of_range(key: str, value: float | None, low: float | None, high: float | None = None) -> str | None:
    """Why `value` (set as `key`) lies outside [low, high] (NaN too), or None; an unset value passes."""
    if value is None:
        return None
    if value != value or (low is not None and value < low) or (high is not None and value > high):  # NaN too
        bounds = f"[{low}, {high if high is not None else 'inf'}]"
        return f"{key}={value} is out of range: it must lie in {bounds}"
    return None


def at_least(prefix: str, values: Iterable[tuple[str, int | None, int]]) -> str | None:
    """The first `prefix.name={value}` below its least value `low`, of `(name, value, low)`; None when none is."""
    for name, value, low in values:
        if value is not None and value < low:
            return f"{prefix}.{name}={value} is out of range: it must be at least {low}"
    return None


def first(*problems: str | None) -> str | None:
    """The first of `problems` that is one (each already computed), or None."""
    return next((p for p in problems if p), None)
