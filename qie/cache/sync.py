"""`python -m qie.cache action=sync sync.to=DEST`: copy the entries of the configured cache into another one (a
local ssd cache into a bucket, or back), each checked after it is written; entries the destination already
holds whole are skipped, so an interrupted sync is resumed by running it again.

A destination with `://` is an object store (the remote backend, with `sync.endpoint_url` and
`sync.storage_options`); anything else is an ssd cache folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from qie.cache.admin import AdminReport
from qie.cache.base import CacheBackend, check_types
from qie.cache.ssd import SsdBackend
from qie.errors import ConfigError


@dataclass
class SyncReport:
    """What a sync did: entries copied, skipped (already there), and those that failed (type, key, why)."""

    copied: int = 0
    skipped: int = 0
    bytes: int = 0
    failed: list[tuple[str, str, str]] = field(default_factory=list)


def destination(
    to: str, endpoint_url: str | None = None, storage_options: Mapping | None = None, local_dir: str | None = None
) -> CacheBackend:
    """The backend `to` names: an object store URL (`scheme://...`) or an ssd cache folder."""
    if "://" in str(to):
        from qie.cache.remote import RemoteBackend

        return RemoteBackend(url=to, endpoint_url=endpoint_url, storage_options=storage_options, local_dir=local_dir)
    return SsdBackend(dir=to)


def place(backend) -> str | None:
    """Where a backend's entries live, to compare two caches: a folder with its links resolved (an ssd cache, a
    `file://` store), or an object store's endpoint and URL; None for a backend held in memory."""
    if isinstance(backend, SsdBackend):
        return os.path.realpath(backend.root)
    store = getattr(backend, "store", None)
    if store is None:
        return None
    return os.path.realpath(store.root) if store.local else f"{backend.endpoint_url or ''} {backend.url}"


def check_apart(source, dest) -> None:
    """Refuse a destination inside the source cache, or a source inside the destination: a copy would nest one cache
    in the other (entries copied into the folders they are listed from).

    Raises:
        ConfigError: naming both places and what to do.
    """
    src, to = place(source), place(dest)
    if src is None or to is None:
        return
    if to == src or to.startswith(src.rstrip("/") + "/"):
        raise ConfigError(f"sync.to {to!r} lies inside the cache it copies ({src!r}): point sync.to outside it")
    if src.startswith(to.rstrip("/") + "/"):
        raise ConfigError(f"the cache sync copies ({src!r}) lies inside sync.to {to!r}: point sync.to elsewhere")


def _order(types: list[str]) -> list[str]:
    """Base entries first (an entry extending another is only whole once its base is there)."""
    return sorted(types, key=lambda t: not t.startswith("empty_"))


def sync(source, dest, types: Iterable[str] | None = None) -> SyncReport:
    """Copy the entries of `types` from `source` to `dest` (backends that list their `keys`); each copy is read
    back and its checksum compared with the source's. Entries `dest` holds whole are skipped.

    Raises:
        ConfigError: `dest` inside `source` or `source` inside `dest` (`check_apart`).
    """
    check_apart(source, dest)
    source.check_access()
    dest.check_access(write=True)
    report, done = SyncReport(), []
    for type in _order(check_types(types)):
        keys = source.keys(type)
        there = dest.intact_all([(type, k) for k in keys]) if keys else []
        for key, whole in zip(keys, there):
            if whole:
                report.skipped += 1
                done.append((type, key))
                continue
            entry = source.get(type, key)
            if entry is None:
                report.failed.append((type, key, "unreadable in the source (see its warning)"))
                continue
            report.bytes += dest.put(type, key, dict(entry), entry.meta)
            back = dest.get(type, key)
            if back is None or back.checksum != entry.checksum:
                report.failed.append((type, key, "the copy read back differs from the source"))
                continue
            report.copied += 1
            done.append((type, key))
    if done:  # every copied entry (and its base) whole; a remote destination writes its index now
        whole = dest.intact_all(done, remember=True)
        report.failed += [(t, k, "not whole after the copy") for (t, k), ok in zip(done, whole) if not ok]
    return report


def sync_report(source, dest, types: Iterable[str] | None = None) -> AdminReport:
    """`sync` as printable lines; exit code 1 when an entry failed."""
    from qie.cache.admin import format_bytes

    r = sync(source, dest, types)
    lines = [
        f"sync: {source!r} -> {dest!r}",
        f"copied {r.copied:,} entries ({format_bytes(r.bytes)}), skipped {r.skipped:,} already there",
    ]
    lines += [f"  failed {t} {k}: {why}" for t, k, why in r.failed]
    if r.failed:
        lines.append(f"{len(r.failed):,} entries failed: run the sync again to retry them")
    return AdminReport("\n".join(lines), exit_code=1 if r.failed else 0)
