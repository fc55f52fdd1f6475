"""The `none` backend: stores nothing, so every lookup misses and embeddings are always computed live."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from qie.cache.base import (
    CacheBackend,
    Entry,
    NoClaim,
    VerifyReport,
    check_entry,
    check_key,
    check_meta,
    check_type,
    check_types,
    empty_stats,
)


class NoneBackend(CacheBackend):
    """Always a miss; `put` accepts and drops the entry. It takes no settings."""

    stores = False
    persists = False
    remote_reads = False

    def __init__(self) -> None:
        pass  # no settings (and no keyword taken: its constructor is what the config is checked against)

    def __repr__(self) -> str:
        return "NoneBackend()"

    def get(self, type: str, key: str) -> Entry | None:
        """Always None."""
        _check(type, key)
        return None

    def put(self, type: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> int:
        """Drops the entry; 0 bytes written."""
        _check(type, key)
        check_entry(tensors)
        check_meta(meta)
        return 0

    def exists(self, type: str, key: str) -> bool:
        """Always False."""
        _check(type, key)
        return False

    def intact(self, type: str, key: str) -> bool:
        """Always False."""
        _check(type, key)
        return False

    def claim(self, type: str, key: str, wait: bool = False) -> NoClaim:
        """Always granted: nothing is ever stored."""
        _check(type, key)
        return NoClaim()

    def sweep_temp(self) -> int:
        """Nothing to sweep: 0."""
        return 0

    def check_access(self, write: bool = False) -> None:
        """Always usable."""

    def keys(self, type: str) -> list[str]:
        """Nothing is stored: []."""
        check_type(type)
        return []

    def stats(self, types: Iterable[str] | None = None) -> dict[str, dict]:
        """Zero entries of every type."""
        return empty_stats(types)

    def clear(self, types: Iterable[str] | None = None) -> int:
        """Nothing to remove: 0."""
        check_types(types)
        return 0

    def verify(self, types: Iterable[str] | None = None, fix: bool = False) -> VerifyReport:
        """Nothing to check."""
        check_types(types)
        return VerifyReport()

    def unused(self, keep: Mapping[str, set[str]], types: Iterable[str] | None = None, remove: bool = False) -> dict:
        """Nothing stored, nothing unused."""
        return empty_stats(types)


def _check(type: str, key: str) -> None:
    check_type(type)
    check_key(key)
