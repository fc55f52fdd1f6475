"""The `memory` backend: entries in a dict of this process, gone when it ends (small sets, tests)."""

from __future__ import annotations

import os
from collections.abc import Iterable

from qie.cache.base import (
    Entry,
    VerifyReport,
    check_entry,
    check_key,
    check_type,
    check_types,
    cpu_copy,
    empty_stats,
)


class MemoryBackend:
    """In-process store; it keeps copies, and hands out copies, so callers cannot change what it holds.

    Args:
        dir: accepted for a uniform constructor (the config passes `cache.dir`) and ignored.
    """

    def __init__(self, dir: str | os.PathLike | None = None) -> None:
        self._entries: dict[str, dict[str, Entry]] = {}

    def __repr__(self) -> str:
        return "MemoryBackend()"

    def get(self, type: str, key: str) -> Entry | None:
        """A copy of the entry, or None on a miss."""
        entry = self._entries.get(check_type(type), {}).get(check_key(key))
        return None if entry is None else {name: t.clone() for name, t in entry.items()}

    def put(self, type: str, key: str, tensors: Entry) -> int:
        """Store a CPU copy of the entry; returns its size in bytes."""
        check_entry(tensors)
        entry = {name: cpu_copy(t) for name, t in tensors.items()}
        self._entries.setdefault(check_type(type), {})[check_key(key)] = entry
        return _nbytes(entry)

    def exists(self, type: str, key: str) -> bool:
        """Whether (type, key) is stored."""
        return check_key(key) in self._entries.get(check_type(type), {})

    def stats(self, types: Iterable[str] | None = None) -> dict[str, dict]:
        """{type: {"count", "bytes"}}, bytes being the tensors' payload."""
        out = empty_stats(types)
        for type, s in out.items():
            entries = self._entries.get(type, {})
            s["count"] = len(entries)
            s["bytes"] = sum(_nbytes(e) for e in entries.values())
        return out

    def clear(self, types: Iterable[str] | None = None) -> int:
        """Drop every entry of `types`; returns how many."""
        return sum(len(self._entries.pop(t, {})) for t in check_types(types))

    def verify(self, types: Iterable[str] | None = None, fix: bool = False) -> VerifyReport:
        """Counts the entries; an in-process copy cannot be corrupt."""
        return VerifyReport(checked=sum(len(self._entries.get(t, {})) for t in check_types(types)))


def _nbytes(entry: Entry) -> int:
    return sum(t.numel() * t.element_size() for t in entry.values())
