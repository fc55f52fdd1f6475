"""Each data file stat'ed once while a start-up reads its data set: the remembered scan that checks an image is
still a file and the key memo that takes its signature share one stat (a million-sample set names 200k images).

Only inside `once()` (the train stage's reading of its data); elsewhere every call stats the file.
"""

from __future__ import annotations

import os
import stat as _stat
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_TAKEN: ContextVar[dict[str, os.stat_result | OSError] | None] = ContextVar("qie_file_stats", default=None)


@contextmanager
def once() -> Iterator[None]:
    """Within this block, `stat` of a path returns what its first call in the block returned (or raised)."""
    token = _TAKEN.set({})
    try:
        yield
    finally:
        _TAKEN.reset(token)


def stat(path: str) -> os.stat_result:
    """`os.stat(path)` (links followed), taken once per path inside `once()`.

    Raises:
        OSError: as `os.stat` does.
    """
    taken = _TAKEN.get()
    if taken is None:
        return os.stat(path)
    found = taken.get(path)
    if found is None:
        try:
            found = os.stat(path)
        except OSError as e:
            found = e
        taken[path] = found
    if isinstance(found, OSError):
        raise found
    return found


def stat_all(paths: list[str]) -> list[os.stat_result | OSError]:
    """`stat` of each path, or the OSError it raised, in one loop (200k images of a folder data set)."""
    taken, os_stat, out = _TAKEN.get(), os.stat, []
    for path in paths:
        found = taken.get(path) if taken is not None else None
        if found is None:
            try:
                found = os_stat(path)
            except OSError as e:
                found = e
            if taken is not None:
                taken[path] = found
        out.append(found)
    return out


def isfile(path: str | os.PathLike) -> bool:
    """`os.path.isfile(path)` through `stat` (the path made absolute, as signatures name it)."""
    p = os.fspath(path)
    try:
        return _stat.S_ISREG(stat(p if p.startswith("/") else os.path.abspath(p)).st_mode)
    except (OSError, ValueError):
        return False
