"""A call running in a thread while the stage does other work (the train stage loads the model's weights while
the data set is scanned)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Background:
    """A call running in a thread; `result()` waits for it and returns its value or raises its error."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="qie-background", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:  # raised again in the caller's thread
            self._error = e

    def wait(self) -> None:
        """Wait for the call to end, whatever its outcome."""
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def in_background(fn: Callable[..., Any], *args: Any) -> Background:
    """Start `fn(*args)` in a thread (see `Background`)."""
    return Background(fn, *args)
