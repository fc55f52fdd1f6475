"""A process-wide flag that a stop was asked for (training's stop signal, `qie.training.loop.StopSignal`): code that
waits on a plug-in's work in another thread (a reward scoring edits, `qie.evaluation.reward.score`) stops waiting
instead of holding the stop up until that work ends."""

from __future__ import annotations

import threading

_REQUESTED = threading.Event()


def request() -> None:
    """Say that a stop was asked for (from a signal handler: only sets a flag)."""
    _REQUESTED.set()


def clear() -> None:
    """Forget a stop asked for earlier (a new run of the loop starts)."""
    _REQUESTED.clear()


def requested() -> bool:
    """Whether a stop was asked for since the last `clear`."""
    return _REQUESTED.is_set()


__all__ = ["clear", "request", "requested"]
