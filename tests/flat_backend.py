"""A cache backend defined outside qie, as a user would write one: every entry is one file in a single folder,
`<dir>/<type>.<key><suffix>`, the suffix being a constructor parameter of its own.

Configured as `cache.backend._target_=flat_backend.FlatBackend +cache.backend.suffix=.entry cache.dir=FOLDER`; the
backend battery (tests/test_backend_battery.py) runs the protocol's contract over it beside qie's own backends.
It reaches qie only through the cache's public pieces: the entry codec, the check helpers and the file helpers.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping

import torch

from qie.cache.base import (
    CacheBackend,
    CorruptEntry,
    Entry,
    VerifyReport,
    base_of,
    check_entry,
    check_key,
    check_meta,
    check_type,
    check_types,
    decode,
    empty_stats,
    encode,
)
from qie.cache.codec import CorruptError, checksum
from qie.cache.files import (
    LOCK_SUFFIX,
    TEMP_SUFFIX,
    FileClaim,
    claim_file,
    is_stale_temp,
    now,
    read_file,
    sweep_lock,
    unlink,
    write_atomic,
)
from qie.errors import CacheDirMissing, ConfigError
from qie.extend import FolderDocuments


class FlatBackend(CacheBackend):
    """Entries as safetensors bytes in one flat folder; only names `<type>.<key><suffix>` are entries."""

    stores = True
    persists = True
    remote_reads = False

    def __init__(self, dir: str | os.PathLike | None, suffix: str) -> None:
        if not dir:
            raise ConfigError("cache.dir is not set: the flat backend keeps its entries in a folder")
        if not suffix.startswith(".") or len(suffix) < 2 or "/" in suffix or suffix in (TEMP_SUFFIX, LOCK_SUFFIX):
            raise ConfigError(f"cache.backend.suffix={suffix!r}: give a file suffix such as '.entry'")
        self.root, self.suffix = os.path.abspath(os.path.expanduser(dir)), suffix

    def __repr__(self) -> str:
        return f"FlatBackend(dir={self.root!r}, suffix={self.suffix!r})"

    @property
    def shared(self) -> FolderDocuments:
        """The stages' shared documents (the precompute failure list) as files beside the entries."""
        return FolderDocuments(self.root)

    def _path(self, type: str, key: str) -> str:
        return f"{self.root}/{check_type(type)}.{check_key(key)}{self.suffix}"

    def _entries(self, types: Iterable[str]) -> Iterator[tuple[str, str, os.DirEntry]]:
        """(type, key, file) of each entry of `types`: regular files named as entries, never a link."""
        wanted = set(types)
        if not os.path.isdir(self.root):
            return
        for e in os.scandir(self.root):
            type, dot, rest = e.name.partition(".")
            if not dot or type not in wanted or not rest.endswith(self.suffix) or not e.is_file(follow_symlinks=False):
                continue
            key = rest[: -len(self.suffix)]
            try:
                yield type, check_key(key), e
            except ValueError:
                continue

    def get(self, type: str, key: str) -> Entry | None:
        path = self._path(type, key)
        try:
            return decode(read_file(path), type)
        except FileNotFoundError:
            return None
        except (OSError, CorruptError):
            return None

    def put(self, type: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> int:
        path = self._path(type, key)
        check_entry(tensors)
        data = encode(tensors, type, check_meta(meta))
        write_atomic(path, data, key)
        return len(data)

    def exists(self, type: str, key: str) -> bool:
        return os.path.isfile(self._path(type, key))

    def intact(self, type: str, key: str) -> bool:
        entry = self.get(type, key)
        if entry is None:
            return False
        base = base_of(entry.meta)
        if base is None:
            return True
        found = self.get(base[0], base[1])
        return found is not None and checksum(found) == base[2]

    def claim(self, type: str, key: str, wait: bool = False) -> FileClaim | None:
        return claim_file(f"{self.root}/.{check_type(type)}.{check_key(key)}{LOCK_SUFFIX}", wait)

    def sweep_temp(self) -> int:
        if not os.path.isdir(self.root):
            return 0
        t, removed = now(), 0
        for e in os.scandir(self.root):
            if is_stale_temp(e, t):
                removed += unlink(e.path)
            elif sweep_lock(e):
                removed += 1
        return removed

    def check_access(self, write: bool = False) -> None:
        if write:
            os.makedirs(self.root, exist_ok=True)
        elif not os.path.isdir(self.root):
            raise CacheDirMissing(f"cache.dir {self.root!r} does not exist")

    def keys(self, type: str) -> list[str]:
        return sorted(key for _, key, _ in self._entries([check_type(type)]))

    def stats(self, types: Iterable[str] | None = None) -> dict[str, dict]:
        out = empty_stats(types)
        for type, _, e in self._entries(out):
            out[type]["count"] += 1
            out[type]["bytes"] += e.stat(follow_symlinks=False).st_size
        return out

    def clear(self, types: Iterable[str] | None = None) -> int:
        return sum(unlink(e.path) for _, _, e in list(self._entries(check_types(types))))

    def verify(self, types: Iterable[str] | None = None, fix: bool = False) -> VerifyReport:
        report = VerifyReport()
        for type, key, e in list(self._entries(check_types(types))):
            report.checked += 1
            try:
                decode(read_file(e.path), type, verify=True)
            except (OSError, CorruptError) as error:
                report.corrupt.append(CorruptEntry(type, key, e.path, str(error)))
                report.removed += fix and unlink(e.path)
        return report

    def unused(
        self, keep: Mapping[str, set[str]], types: Iterable[str] | None = None, remove: bool = False
    ) -> dict[str, dict]:
        kept = {t: set(keep.get(t, ())) for t in check_types(None)}
        for type, key in [(t, k) for t, ks in kept.items() for k in ks]:
            entry = self.get(type, key)
            base = base_of(entry.meta) if entry is not None else None
            if base is not None:
                kept[base[0]].add(base[1])
        out = empty_stats(types)
        for type, key, e in list(self._entries(out)):
            if key not in kept[type]:
                out[type]["count"] += 1
                out[type]["bytes"] += e.stat(follow_symlinks=False).st_size
                if remove:
                    unlink(e.path)
        return out
