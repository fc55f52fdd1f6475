"""The `memory` backend: entries in a dict of this process, gone when it ends (small sets, tests)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from qie.cache.base import (
    CacheBackend,
    Entry,
    NoClaim,
    VerifyReport,
    base_of,
    check_entry,
    check_key,
    check_meta,
    check_type,
    check_types,
    cpu_copy,
    empty_stats,
)
from qie.cache.codec import checksum


class MemoryBackend(CacheBackend):
    """In-process store; it keeps copies, and hands out copies, so callers cannot change what it holds. It takes
    no settings: an in-process copy cannot rot, so there is nothing to verify on reads."""

    stores = True
    persists = False
    remote_reads = False

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Entry]] = {}
        self._checksums: dict[tuple[str, str], str] = {}  # what the ssd backend keeps in each file's header

    def __repr__(self) -> str:
        return "MemoryBackend()"

    def get(self, type: str, key: str) -> Entry | None:
        """A copy of the entry, or None on a miss."""
        entry = self._entries.get(check_type(type), {}).get(check_key(key))
        if entry is None:
            return None
        return Entry({name: t.clone() for name, t in entry.items()}, entry.meta, self._checksums[type, key])

    def put(self, type: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> int:
        """Store a CPU copy of the entry; returns its size in bytes."""
        check_entry(tensors)
        entry = Entry({name: cpu_copy(t) for name, t in tensors.items()}, check_meta(meta))
        self._entries.setdefault(check_type(type), {})[check_key(key)] = entry
        self._checksums[type, key] = checksum(entry)
        return _nbytes(entry)

    def exists(self, type: str, key: str) -> bool:
        """Whether (type, key) is stored."""
        return check_key(key) in self._entries.get(check_type(type), {})

    def intact(self, type: str, key: str) -> bool:
        """Stored, and its base (if any) stored with the recorded checksum."""
        entry = self._entries.get(check_type(type), {}).get(check_key(key))
        if entry is None:
            return False
        base = base_of(entry.meta)
        if base is None:
            return True
        return base[1] in self._entries.get(base[0], {}) and self._checksums.get(base[:2]) == base[2]

    def claim(self, type: str, key: str, wait: bool = False) -> NoClaim:
        """Always granted: no other process shares these entries."""
        return NoClaim()

    def sweep_temp(self) -> int:
        """Nothing is left behind in memory: 0."""
        return 0

    def check_access(self, write: bool = False) -> None:
        """Always usable."""

    def keys(self, type: str) -> list[str]:
        """The keys stored under `type`, sorted."""
        return sorted(self._entries.get(check_type(type), {}))

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

    def unused(
        self, keep: Mapping[str, set[str]], types: Iterable[str] | None = None, remove: bool = False
    ) -> dict[str, dict]:
        """The entries no kept entry needs (see the protocol); dropped with `remove`."""
        kept = {t: set(keep.get(t, ())) for t in self._entries}
        for type, key in [(t, k) for t, ks in kept.items() for k in ks]:
            entry = self._entries[type].get(key)
            base = base_of(entry.meta) if entry is not None else None
            if base is not None:
                kept.setdefault(base[0], set()).add(base[1])
        out = empty_stats(types)
        for type, s in out.items():
            entries = self._entries.get(type, {})
            for key in [k for k in entries if k not in kept.get(type, set())]:
                s["count"] += 1
                s["bytes"] += _nbytes(entries.pop(key) if remove else entries[key])
        return out


def _nbytes(entry: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in entry.values())
