"""Admin actions of the `remote` backend (stats, clear, verify, unused): they list the entry objects of each type
folder under the backend's root and touch nothing but key-named entry objects there (and the backend's index
and this node's copies of those entries)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import safetensors
import torch

from qie.cache.base import CorruptEntry, VerifyReport, base_of, check_key, check_type, decode, empty_stats
from qie.cache.codec import CorruptError
from qie.cache.local_copy import LocalCopy
from qie.cache.remote_index import RemoteIndex
from qie.cache.remote_segments import Record
from qie.cache.remote_store import Store


class RemoteBackend(Protocol):
    """What the admin actions use of `qie.cache.remote.RemoteBackend` (which calls them: named here, not imported)."""

    store: Store
    index: RemoteIndex
    local: LocalCopy

    def name(self, type: str, key: str) -> str: ...

    def probe(self, type: str, key: str, local: bool = True) -> Record | None: ...

    def entries(self, type: str, report: VerifyReport | None = None) -> dict[str, int]: ...


def stats(backend: RemoteBackend, types: list[str]) -> dict[str, dict]:
    """{type: {"count", "bytes"}} of the entry objects."""
    out = empty_stats(types)
    for type in types:
        sizes = backend.entries(type)
        out[type] = {"count": len(sizes), "bytes": sum(sizes.values())}
    return out


def clear(backend: RemoteBackend, types: list[str]) -> int:
    """Remove every entry object of `types` (and their index and local copies); returns how many went."""
    removed = 0
    for type in types:
        seen = VerifyReport()
        for key in backend.entries(type, seen):
            removed += backend.store.remove(backend.name(type, key))
            backend.local.drop(type, key)
        if not seen.skipped:  # a linked type folder of a `file://` store is left as it is, index and all
            backend.index.clear(type)
    return removed


def verify(backend: RemoteBackend, types: list[str], fix: bool) -> VerifyReport:
    """Read back every entry object, and report the entries the index lists whose object is missing; with `fix`,
    remove the corrupt ones and rewrite the index of each type as what is stored whole (entries missing from it
    added, removed and missing ones dropped)."""
    report = VerifyReport()
    for type in types:
        skipped = len(report.skipped)
        stored = backend.entries(type, report)
        if len(report.skipped) > skipped:
            continue  # a linked type folder of a `file://` store: not looked into, its index left as it is
        bad: set[str] = set()
        for key in sorted(set(backend.index.records(type)) - set(stored)):
            report.checked += 1
            reason = "listed in the cache's index, but its object is missing (verify.fix=true drops it from the index)"
            report.corrupt.append(CorruptEntry(type, key, backend.store.path(backend.name(type, key)), reason))
            if fix:  # the index is rewritten without it below
                report.removed += 1
                backend.local.drop(type, key)
        for key in sorted(stored):
            report.checked += 1
            reason = check_object(backend, type, key)
            if reason is None:
                continue
            bad.add(key)
            report.corrupt.append(CorruptEntry(type, key, backend.store.path(backend.name(type, key)), reason))
            if fix and backend.store.remove(backend.name(type, key)):
                report.removed += 1
            if fix:
                backend.local.drop(type, key)
        if fix:
            reindex(backend, type, set(stored) - bad)
    return report


def check_object(backend: RemoteBackend, type: str, key: str) -> str | None:
    """Why the stored object is not a good entry, or None when it is."""
    try:
        data = backend.store.read(backend.name(type, key))
        entry = decode(torch.frombuffer(bytearray(data), dtype=torch.uint8), type, verify=True, key=key)
        safetensors.deserialize(data)  # the library itself must accept it too
    except FileNotFoundError:
        return "missing"
    except CorruptError as e:
        return str(e)
    except Exception as e:  # any failure to read back makes it corrupt
        return f"{e.__class__.__name__}: {e}"
    return base_problem(backend, entry.meta)


def reindex(backend: RemoteBackend, type: str, present: set[str]) -> None:
    """Make the index of `type` list exactly the entries of `present` (reading headers of those it lacks)."""
    known = backend.index.records(type)
    gone = set(known) - present
    if gone:
        backend.index.forget(type, gone)
    for key in sorted(present - set(known)):
        record = backend.probe(type, key)
        if record is not None:
            backend.index.add(type, key, record)
    backend.index.flush()


def unused(backend: RemoteBackend, keep: Mapping[str, set[str]], types: list[str], remove: bool) -> dict[str, dict]:
    """The entry objects of `types` no kept entry needs (a kept prompt entry keeps its base); removed with
    `remove`."""
    kept = {t: set(keep.get(t, ())) for t in keep}
    for type, keys in list(kept.items()):
        for key in list(keys):
            record = (backend.index.get(type, key) or backend.probe(type, key)) if _valid(type, key) else None
            if record is not None and record[2]:
                base_type, _, rest = record[2].partition("/")
                kept.setdefault(base_type, set()).add(rest.partition("/")[0])
    out = empty_stats(types)
    for type in types:
        gone = set()
        for key, size in backend.entries(type).items():
            if key in kept.get(type, set()):
                continue
            if remove:
                if not backend.store.remove(backend.name(type, key)):
                    continue
                backend.local.drop(type, key)
                gone.add(key)
            out[type]["count"] += 1
            out[type]["bytes"] += size
        if gone:
            backend.index.forget(type, gone)
    return out


def base_problem(backend: RemoteBackend, meta: dict[str, str]) -> str | None:
    """Why the base an entry extends is not usable, or None (also for an entry without a base)."""
    base = base_of(meta)
    if base is None:
        return None
    type, key, digest = base
    if not _valid(type, key):
        return f"names a bad base entry {type}/{key}"
    record = backend.index.get(type, key) or backend.probe(type, key)
    if record is None:
        return f"its base entry {type}/{key} is missing or damaged"
    if record[1] != digest:
        return f"its base entry {type}/{key} was rewritten (checksum {record[1]}, recorded {digest})"
    return None


def _valid(type: str, key: str) -> bool:
    try:
        check_type(type), check_key(key)
    except ValueError:
        return False
    return True
