"""Each data file stat'ed once while a start-up reads its data set: the remembered scan that checks an image is
still a file and the key memo that takes its signature share one stat (a million-sample set names 200k images);
and an image's signature text, from its stat.

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
    (found,) = stat_all([path])
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
        return _stat.S_ISREG(stat(_absolute(p)).st_mode)
    except (OSError, ValueError):
        return False


def signature(path: str | os.PathLike, seen: dict[str, str | OSError] | None, fresh: bool = False) -> str:
    """An image's signature text: its absolute path, size, mtime_ns, ctime_ns and inode (a write changes its ctime,
    which no tool can set back). `seen`: texts (or the OSError of the stat) already taken in this pass, by the path
    as given; `fresh` stats anew even inside `once()`.

    Raises:
        OSError: the image cannot be stat'ed.
    """
    p = os.fspath(path)
    if seen is not None and (known := seen.get(p)) is not None:
        if isinstance(known, OSError):
            raise known
        return known
    full = _absolute(p)
    try:
        st = os.stat(full) if fresh else stat(full)
    except OSError as e:
        if seen is not None:
            seen[p] = e
        raise
    text = _text(full, st)
    if seen is not None:
        seen[p] = text
    return text


def signatures(paths: list, seen: dict[str, str | OSError]) -> list[str] | None:
    """`signature` of each path (None when one cannot be stat'ed), in one loop; `seen` as in `signature`."""
    names = list(map(os.fspath, paths))
    todo = [p for p in names if p not in seen]
    full = list(map(_absolute, todo))
    for p, f, st in zip(todo, full, stat_all(full)):
        seen[p] = st if isinstance(st, OSError) else _text(f, st)
    texts = [seen[p] for p in names]
    return None if any(isinstance(t, OSError) for t in texts) else texts  # type: ignore[return-value]


def _text(full: str, st: os.stat_result) -> str:
    return f"{full}\0{st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}"


def _absolute(path: str) -> str:
    """`path` made absolute, as signatures name it (an absolute one as it is, without a call)."""
    return path if path.startswith("/") else os.path.abspath(path)
