"""Progress for terminals and for log files.

On a terminal, a tqdm bar. When the output is not a terminal (a log file, a pipe, a cluster job), tqdm's
carriage-return rewrites would pile up into one line of thousands of characters; there, progress is plain
lines instead: one each 10% of the run or each 30 seconds, whichever comes first, and one at the end.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

PLAIN_EVERY_SECONDS = 30.0
PLAIN_EVERY_FRACTION = 0.1


def interactive(stream: TextIO | None = None) -> bool:
    """Whether `stream` (default: stderr, where progress goes) is a terminal."""
    stream = stream if stream is not None else sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


def progress(total: int | None, desc: str, initial: int = 0, disable: bool = False, unit: str = "it") -> Any:
    """A progress reporter with tqdm's `update`, `set_postfix` and `close` (and a context manager):
    a tqdm bar on a terminal, plain lines (`PlainProgress`) otherwise."""
    if interactive():
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, initial=initial, disable=disable, unit=unit)
    return PlainProgress(total, desc, initial, disable, unit)


def quiet_library_bars() -> None:
    """Turn off the progress bars of transformers, diffusers, huggingface_hub (weight loading, shard
    writing) and, once imported, datasets when the output is not a terminal: a log file cannot hold tqdm bars."""
    if interactive():
        return
    import importlib

    for module, function in (
        ("transformers.utils.logging", "disable_progress_bar"),
        ("diffusers.utils.logging", "disable_progress_bar"),
        ("huggingface_hub.utils", "disable_progress_bars"),
        ("datasets.utils", "disable_progress_bars"),
    ):
        if module.startswith("datasets") and "datasets" not in sys.modules:
            continue  # a heavy import that only Hugging Face data sets need: done when one is read
        try:
            getattr(importlib.import_module(module), function)()
        except (ImportError, AttributeError):  # an optional library that is not installed
            pass


class PlainProgress:
    """Progress as whole lines, `desc: 40/400 (10%) loss=0.1234, 2.10 it/s, 2m51s left`.

    A line is written when 10% of `total` (or `every_seconds`) has passed since the last one, and at the end.
    """

    def __init__(
        self,
        total: int | None,
        desc: str,
        initial: int = 0,
        disable: bool = False,
        unit: str = "it",
        stream: TextIO | None = None,
        every_seconds: float = PLAIN_EVERY_SECONDS,
        clock=time.monotonic,
    ) -> None:
        self.total, self.desc, self.n, self.disable, self.unit = total, desc, initial, disable, unit
        self.stream, self.every_seconds, self.clock = stream, every_seconds, clock
        self.postfix = ""
        self._start_n, self._start = initial, clock()
        self._last_n, self._last = initial, self._start
        self._step = max(1, round((total or 0) * PLAIN_EVERY_FRACTION))
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if self.n - self._last_n >= self._step or now - self._last >= self.every_seconds:
            self._write(now)

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if not self._closed and self.n != self._last_n:
            self._write(self.clock())
        self._closed = True

    def line(self, now: float) -> str:
        done = f"{self.n}/{self.total} ({100 * self.n / self.total:.0f}%)" if self.total else f"{self.n}"
        parts = [f"{self.desc}: {done}"]
        if self.postfix:
            parts.append(self.postfix)
        elapsed = now - self._start
        rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
        if rate > 0:
            parts.append(f"{rate:.2f} {self.unit}/s")
            if self.total:
                parts.append(f"{_duration(max(0, self.total - self.n) / rate)} left")
        return ", ".join(parts)

    def _write(self, now: float) -> None:
        self._last_n, self._last = self.n, now
        if not self.disable:
            print(self.line(now), file=self.stream if self.stream is not None else sys.stderr, flush=True)

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
