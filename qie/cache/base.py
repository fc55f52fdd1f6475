"""The cache backend protocol, its report types and the checks every backend shares.

An entry is stored as the bytes of one safetensors file (`qie.cache.codec`), whatever holds the bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from qie.cache.codec import CorruptError, Entry, cpu_copy, decode, encode
from qie.types import CACHE_TYPES, SCHEMA_VERSION

_KEY_RE = re.compile(r"[0-9A-Za-z_-]{2,128}")


@dataclass
class CorruptEntry:
    """An entry that cannot be read back: where it is and why."""

    type: str
    key: str
    path: str
    reason: str


class EntryCounts(Mapping[tuple[str, str], int]):
    """Distinct entries (type, key) and how often a set of samples names each: a mapping, held per type as a list
    of keys and an array of counts, so a million distinct entries need no tuple each unless one is asked for.

    Args:
        by_type: type -> (keys, counts) or (keys, counts, prefixes): `prefixes`, where given, are the first 8
            bytes of each hex key as a big-endian uint64 array (what `int(key[:16], 16)` gives).
        hex_keys: every key was made here as the hex digits of bytes (no key needs `check_keys`).
    """

    def __init__(self, by_type: Mapping[str, tuple], hex_keys: bool = False) -> None:
        self._by_type = {t: tuple(v) + (None,) * (3 - len(v)) for t, v in by_type.items() if len(v[0])}
        self._lookup: dict[tuple[str, str], int] | None = None
        self.hex_keys = hex_keys

    @classmethod
    def of(cls, counts: Mapping[tuple[str, str], int]) -> EntryCounts:
        """`counts` as EntryCounts (itself when it is one)."""
        if isinstance(counts, EntryCounts):
            return counts
        grouped: dict[str, tuple[list[str], list[int]]] = {}
        for (type, key), n in counts.items():
            keys, times = grouped.setdefault(type, ([], []))
            keys.append(key)
            times.append(n)
        return cls({t: (keys, times) for t, (keys, times) in grouped.items()})

    def by_type(self) -> dict[str, tuple]:
        """type -> (keys, counts, prefixes or None), in this mapping's order."""
        return self._by_type

    def __iter__(self):
        for type, (keys, _, _) in self._by_type.items():
            for key in keys:
                yield type, key

    def __len__(self) -> int:
        return sum(len(v[0]) for v in self._by_type.values())

    def __getitem__(self, item: tuple[str, str]) -> int:
        if self._lookup is None:
            self._lookup = {
                (t, k): int(n) for t, (keys, times, _) in self._by_type.items() for k, n in zip(keys, times)
            }
        return self._lookup[item]


@dataclass
class VerifyReport:
    """What `verify` found: entries checked, the corrupt ones, and how many files it removed."""

    checked: int = 0
    corrupt: list[CorruptEntry] = field(default_factory=list)
    removed: int = 0
    # Temp files of writers that died mid-write; never entries, listed so `fix` can sweep them.
    stale_temp: list[str] = field(default_factory=list)
    temp_removed: int = 0
    # Folders not looked into: type folders that are symlinks (admin actions never leave the cache folder).
    skipped: list[str] = field(default_factory=list)

    @property
    def unfixed(self) -> int:
        """Corrupt entries still on disk."""
        return len(self.corrupt) - self.removed


# What `Documents.update` is given: the document's bytes (None: there is none); what it returns replaces them
# (None: keep them).
Change = Callable[[bytes | None], bytes | None]


@runtime_checkable
class Documents(Protocol):
    """Named byte documents the stages keep beside a cache's entries (`CacheStore.shared`), each rewritten whole by
    one writer at a time (other writers wait). Kinds: `ProcessDocuments` below, `qie.cache.documents.FolderDocuments`
    (files of a folder), `qie.cache.remote_shared.SharedDocuments` (an object store)."""

    def read(self, name: str) -> bytes | None:
        """The document's bytes, or None when there is none."""
        ...

    def update(self, name: str, change: Change) -> None:
        """Replace the document by `change(its bytes or None)` (None: leave it), holding it against other
        writers, so that several processes merge their changes instead of losing one another's."""
        ...


class ProcessDocuments:
    """Documents held by this process only: for a cache that does not outlive it (the protocol's default)."""

    def __init__(self) -> None:
        self._docs: dict[str, bytes] = {}

    def __repr__(self) -> str:
        return "ProcessDocuments()"

    def read(self, name: str) -> bytes | None:
        return self._docs.get(name)

    def update(self, name: str, change: Change) -> None:
        data = change(self._docs.get(name))
        if data is not None:
            self._docs[name] = data


class Claim(Protocol):
    """A lock on one entry while this process computes it; `release` when written (or given up)."""

    def release(self) -> None: ...


class CacheStore(Protocol):
    """Stores entries (dicts of named tensors with a few str facts, `Entry.meta`) under (type, key): what the
    sources, precompute and training read and write.

    `get` returns None on a miss and on an entry it cannot read (after logging a warning naming it);
    it never raises for a bad entry. Types are the names in `CACHE_TYPES`. Readers never create anything;
    `check_access(write=True)` prepares a store for writing. Stages ask the store what it is (`stores`, `persists`,
    `remote_reads`), never its class or its config name. What the stages share beside the entries goes through
    `shared`. The bulk checks (`intact_all`, `intact_counted`) are given
    over `intact`; a store with a faster way overrides them.
    """

    # Whether `put` keeps what it is given: False for a backend that is no cache at all (every source then
    # encodes live).
    stores: bool

    # Whether entries outlive this process (precompute fills only such a cache).
    persists: bool

    # Whether each `get` may be a round trip to another machine (an object store): readers then fetch a sample's
    # entries at once, from several threads, so the waits overlap.
    remote_reads: bool

    @property
    def shared(self) -> Documents:
        """The small documents the stages keep beside the entries (the precompute failure list), shared with every
        process that uses this cache (`Documents`). Given: documents of this process only, for a cache
        that does not outlive it; a backend whose entries do keeps them where its entries are."""
        docs = self.__dict__.get("_process_documents")
        if docs is None:
            docs = self.__dict__["_process_documents"] = ProcessDocuments()
        return docs

    def get(self, type: str, key: str) -> Entry | None: ...

    def put(self, type: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> int: ...

    def exists(self, type: str, key: str) -> bool:
        """Whether something is stored under (type, key); its content is not checked."""
        ...

    def intact(self, type: str, key: str) -> bool:
        """Whether the entry is stored whole, judged by its header (schema, type, length) and, for an entry
        that extends another (`base_of`), that base's header and checksum; the tensor bytes are not read."""
        ...

    def intact_all(self, items: Sequence[tuple[str, str]], remember: bool = False) -> list[bool]:
        """`intact` of many (type, key) entries. With `remember`, a file backend records that this set of
        entries was whole, so that while none of its files changes, the next check costs one stat per file."""
        return [self.intact(t, k) for t, k in items]

    def intact_counted(self, counts: Mapping[tuple[str, str], int], remember: bool = False) -> bool:
        """Whether every entry `counts` counts (by how many samples name it) is intact: `all(intact_all(items))`
        of the items it counts, with the same memory, without the list of items (a million samples name four
        million entries). The start-up check passes an `EntryCounts` (a mapping held per type as arrays)."""
        return all(self.intact_all(list(counts), remember))

    def claim(self, type: str, key: str, wait: bool = False) -> Claim | None:
        """Lock (type, key) against other processes computing it: None when another holds it (`wait`
        blocks until it is free). Released by the holder, or by the system when the holder dies."""
        ...

    def check_access(self, write: bool = False) -> None:
        """Raise StorageError naming the place and what to do when it cannot be read (or written)."""
        ...


class CacheMaintenance(Protocol):
    """What the cache's admin stage and `gc` do to a store (`python -m qie.cache action=...`); `types=None` means
    all types."""

    def sweep_temp(self) -> int:
        """Remove what writers that died left behind (temp files, lock files); returns how many."""
        ...

    def keys(self, type: str) -> list[str]:
        """The keys stored under `type`, sorted (what `action=sync` copies)."""
        ...

    def stats(self, types: Iterable[str] | None = None) -> dict[str, dict]: ...

    def clear(self, types: Iterable[str] | None = None) -> int: ...

    def verify(self, types: Iterable[str] | None = None, fix: bool = False) -> VerifyReport: ...

    def unused(
        self, keep: Mapping[str, set[str]], types: Iterable[str] | None = None, remove: bool = False
    ) -> dict[str, dict]:
        """{type: {"count", "bytes"}} of the entries whose key is neither in `keep[type]` nor the base of a kept
        entry (`base_of`); with `remove`, they are deleted. Nothing but entries is ever touched."""
        ...


@runtime_checkable
class CacheBackend(CacheStore, CacheMaintenance, Protocol):
    """A cache backend: the store and its maintenance. Built by `hydra.utils.instantiate` from the `cache` config
    node: its constructor takes its own settings (and `dir`, `verify_reads` when it names them). A backend that
    subclasses it gets the bulk checks over its `intact`."""


def check_type(type: str) -> str:
    """Return `type` if it is a cache type; raise ValueError naming the valid types otherwise."""
    if type not in CACHE_TYPES:
        raise ValueError(f"unknown cache type {type!r}: valid types are {', '.join(CACHE_TYPES)}")
    return type


def check_types(types: Iterable[str] | None) -> list[str]:
    """The cache types named by `types` (all of them for None), each checked, in canonical order."""
    if types is None:
        return list(CACHE_TYPES)
    if isinstance(types, str):
        types = [types]
    wanted = {check_type(t) for t in types}
    return [t for t in CACHE_TYPES if t in wanted]


def check_key(key: str) -> str:
    """Return `key` if it is safe as a file name (letters, digits, `_`, `-`); raise ValueError otherwise."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"bad cache key {key!r}: expected 2-128 characters of [0-9A-Za-z_-]")
    return key


def check_keys(keys: Sequence[str]) -> None:
    """`check_key` of each key (one pass of the pattern over all of them; the first bad key is named)."""
    try:
        if all(map(_KEY_RE.fullmatch, keys)):
            return
    except TypeError:  # a key that is no str: named below
        pass
    for key in keys:
        check_key(key)


def check_entry(tensors: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless `tensors` is a non-empty dict of str -> torch.Tensor."""
    if not isinstance(tensors, dict) or not tensors:
        raise ValueError("a cache entry is a non-empty dict of name -> tensor")
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"cache entry item {name!r}: expected a str name and a torch.Tensor")


def empty_stats(types: Iterable[str] | None) -> dict[str, dict]:
    """{type: {"count": 0, "bytes": 0}} for every requested type."""
    return {t: {"count": 0, "bytes": 0} for t in check_types(types)}


def check_meta(meta: dict[str, str] | None) -> dict[str, str]:
    """`meta` as a dict of str -> str; raise ValueError for anything else."""
    meta = dict(meta or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ValueError(f"cache entry meta must map str to str, got {meta!r}")
    return meta


def base_of(meta: dict[str, str]) -> tuple[str, str, str] | None:
    """(type, key, checksum) of the entry this one extends (`meta["base"]`), or None.

    An entry may keep only what it adds to another entry (a prompt embedding keeps its suffix and reads its
    image-token prefix from the empty-prompt embedding of the same images); it is whole only while that base
    is stored with the checksum recorded here.
    """
    ref = meta.get("base")
    if not ref:
        return None
    type, _, key = ref.partition("/")
    return type, key, meta.get("base_checksum", "")


class NoClaim:
    """A claim that holds nothing: backends whose entries live in one process need no lock."""

    def release(self) -> None:
        pass


__all__ = [
    "CacheMaintenance",
    "CacheStore",
    "SCHEMA_VERSION",
    "CacheBackend",
    "Claim",
    "CorruptEntry",
    "CorruptError",
    "Entry",
    "NoClaim",
    "VerifyReport",
    "base_of",
    "check_entry",
    "check_key",
    "check_keys",
    "check_meta",
    "check_type",
    "check_types",
    "cpu_copy",
    "decode",
    "empty_stats",
    "encode",
]
