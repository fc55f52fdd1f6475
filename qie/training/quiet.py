"""Library log lines that say nothing a qie line does not: silenced where they are made, for a moment."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

# accelerate's save_state / load_state log one INFO line per file written or read.
ACCELERATE_CHECKPOINT_LOGGERS = ("accelerate.accelerator", "accelerate.checkpointing")


@contextmanager
def quiet_loggers(
    names: tuple[str, ...] = ACCELERATE_CHECKPOINT_LOGGERS, level: int = logging.WARNING
) -> Iterator[None]:
    """Drop records below `level` from the named loggers inside the block (warnings still pass)."""
    loggers = [logging.getLogger(name) for name in names]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(level, lg.getEffectiveLevel()))
    try:
        yield
    finally:
        for lg, old in zip(loggers, before):
            lg.setLevel(old)
