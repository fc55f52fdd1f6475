"""The ssd backend's folders: which type and shard folders admin actions may look into, which files in
them are entries, and the stamps that let a repeat whole-set check cost one stat per folder (or per entry)."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence

from qie.cache.base import EntryCounts, VerifyReport
from qie.cache.files import SUFFIX, entry_key
from qie.types import CACHE_TYPES

log = logging.getLogger("qie.cache.ssd")

# Kept off a stamp's time when the file system's clock cannot be read, for file systems whose clock (which
# sets ctime) is another machine's.
CHECK_MARGIN_NS = 600 * 10**9
# One tick of the kernel's coarse clock: a time it sets may be this much behind a fine-grained time set just before
# (on another file, or on the probe a stamp's time is read from), so times closer than this are not ordered.
TICK_NS = 10**7


class _Salts(dict):
    """Each cache type's salt, made on first use (a sample field's type is a cache type once it is declared)."""

    def __missing__(self, type: str) -> int:
        self[type] = salt = int(hashlib.sha256(type.encode()).hexdigest()[:16], 16)
        return salt


_TYPE_SALT = _Salts((t, int(hashlib.sha256(t.encode()).hexdigest()[:16], 16)) for t in CACHE_TYPES)


def real_types(root: str, types: Iterable[str], report: VerifyReport | None = None) -> Iterator[str]:
    """The types whose folders are real folders of `root` (a symlinked one is skipped, with a warning)."""
    for type in types:
        folder = f"{root}/{type}"
        if os.path.islink(folder):
            log.warning("skipping %s: a symlink (admin actions never follow links out of the cache)", folder)
            if report is not None:
                report.skipped.append(folder)
            continue
        yield type


def scan(root: str, type: str) -> Iterator[os.DirEntry]:
    """Files (not links) in the real shard folders of `type`, via os.scandir (no per-file stat)."""
    try:
        shards = [e for e in os.scandir(f"{root}/{type}") if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return
    for shard in shards:
        try:
            with os.scandir(shard.path) as it:
                yield from (e for e in it if e.is_file(follow_symlinks=False))
        except FileNotFoundError:
            continue


def shard_key(entry: os.DirEntry) -> str | None:
    """The key of an entry file: key-named and in its key's shard folder; None for any other file."""
    key = entry_key(entry.name)
    return key if key is not None and os.path.basename(os.path.dirname(entry.path)) == key[:2] else None


def entry_sizes(root: str, type: str, report: VerifyReport | None = None) -> dict[str, int]:
    """{key: size} of the entry files of `type` in the real type and shard folders of `root`: all that admin actions
    may touch (a symlinked type folder is skipped, and named in `report`)."""
    out = {}
    for t in real_types(root, [type], report):
        for entry in scan(root, t):
            key = shard_key(entry)
            try:
                if key is not None:
                    out[key] = entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
    return out


def remove_empty_dirs(root: str, type: str) -> None:
    folder = f"{root}/{type}"
    try:
        shards = [e.path for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return
    for path in [*shards, folder]:
        try:
            os.rmdir(path)
        except OSError:
            pass  # not empty, or a writer just used it


def checked_token(items: Sequence[tuple[str, str]]) -> str:
    """A name for a set of (type, key) entries, whatever their order (keys are hex digests: their first 64
    bits are mixed with the type's; other keys are hashed first)."""
    return counted_token(Counter(items))


def counted_token(counts: Mapping[tuple[str, str], int]) -> str:
    """`checked_token` of the items that `counts` counts (each (type, key) as often as its count); from the
    arrays of an `EntryCounts` that holds its keys' prefixes, without a pass per key."""
    import numpy as np

    if isinstance(counts, EntryCounts) and all(v[2] is not None for v in counts.by_type().values()):
        total, n = 0, 0
        for type, (_, times, prefixes) in counts.by_type().items():
            weights = np.asarray(times, dtype=np.uint64)
            parts = np.asarray(prefixes, dtype=np.uint64) ^ np.uint64(_TYPE_SALT[type])
            total += int(np.sum(parts * weights, dtype=np.uint64))  # uint64 arithmetic wraps: mod 2**64
            n += int(weights.sum())
        return f"{n}-{total % (1 << 64):016x}"
    n = sum(counts.values())
    try:  # at once: hex keys (what sample keys are), a million in a fraction of a second
        parts = np.array([int(k[:16], 16) for _, k in counts], dtype=np.uint64)
        salts = np.array([_TYPE_SALT[t] for t, _ in counts], dtype=np.uint64)
        weights = np.array(list(counts.values()), dtype=np.uint64)
        total = int(np.sum((parts ^ salts) * weights, dtype=np.uint64))  # uint64 arithmetic wraps: mod 2**64
    except (ValueError, OverflowError):  # a key that is not hex
        total = 0
        for (t, k), count in counts.items():
            try:
                part = int(k[:16], 16)
            except ValueError:
                part = int(hashlib.blake2b(k.encode(), digest_size=8).hexdigest(), 16)
            total += (part ^ _TYPE_SALT[t]) * count
    return f"{n}-{total % (1 << 64):016x}"


def file_system_now(folder: str) -> int | None:
    """The time of the clock that sets ctimes in `folder`, read from a file created (and removed) there, less
    `TICK_NS`; where no file can be made, this machine's clock less `CHECK_MARGIN_NS`."""
    probe = f"{folder}/.now.{os.getpid()}.{time.monotonic_ns()}"
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            return os.fstat(fd).st_ctime_ns - TICK_NS
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError:
        return time.time_ns() - CHECK_MARGIN_NS


# A stamp's flag that its set was checked with each header's key compared with the key it is stored under (stamps of
# before are taken as no stamp: the set is checked file by file once).
KEYED = "keys"


def read_stamp(path: str) -> tuple[int | None, frozenset[str]]:
    """(the time before which every entry of the set that existed was whole, or None; what else the stamp says:
    "all" when every entry existed, "folders" when the file system kept the set's folder times, `KEYED`)."""
    try:
        with open(path) as f:
            words = f.read().split()
        return int(words[0]), frozenset(words[1:])
    except (OSError, ValueError, IndexError):
        return None, frozenset()


def stamp_text(since: int, flags: Iterable[str]) -> str:
    return " ".join([str(since), *sorted(flags)])


def folder_times_kept(root: str, keys: Mapping[str, Sequence[str]], times: Sequence[int | None]) -> bool:
    """Whether each shard folder of the set is at least as new as the newest of its entry files (`times`, the
    files' ctimes in the order of `keys`), to within `TICK_NS`: a rename into a folder sets the folder's ctime, so a
    file system that keeps folder times passes; one that does not (some FUSE mounts of object stores) fails, and
    its sets are checked file by file."""
    newest: dict[str, int] = {}
    found = iter(times)
    for type, ks in keys.items():
        for key, c in zip(ks, found):
            if c is not None and c > newest.get(f := f"{root}/{type}/{key[:2]}", -1):
                newest[f] = c
    return all(c is not None and c >= newest[f] - TICK_NS for f, c in zip(newest, ctimes(list(newest))))


def unchanged_entries(root: str, keys: Mapping[str, Sequence[str]], since: int, all_exist: bool) -> list[bool] | None:
    """Which entries exist (for the types' `keys`, in their order), when no entry was added, removed or replaced
    in their type and shard folders since `since`; None when one of the folders changed (or is gone).

    Every writer puts an entry by renaming a finished file into its shard folder, and every removal unlinks it:
    both set the folder's ctime, which no tool can set back. A file rewritten in place leaves the folder as it
    was: it is found when read (its header, size and base; with cache.verify_reads its checksum)."""
    shards = {t: {k[:2] for k in ks} for t, ks in keys.items()}
    folders = [f"{root}/{t}" for t in shards] + [f"{root}/{t}/{s}" for t, ss in shards.items() for s in ss]
    times = ctimes(folders)
    if any(c is not None and c >= since for c in times):
        return None
    absent = {f for f, c in zip(folders, times) if c is None}  # holding none of the set's entries
    if all_exist:
        return None if absent else [True] * sum(len(ks) for ks in keys.values())
    found: list[bool] = []
    for type, ks in keys.items():
        try:
            names = {
                s: set() if f"{root}/{type}/{s}" in absent else set(os.listdir(f"{root}/{type}/{s}"))
                for s in shards[type]
            }
        except OSError:
            return None
        found.extend(f"{k}{SUFFIX}" in names[k[:2]] for k in ks)
    return found


def ctimes(paths: Sequence[str]) -> list[int | None]:
    """`ctime` of each path (None where it cannot be stat'ed). One loop in this thread: stats of cached inodes
    are bound by the interpreter, not the file system (4 threads were no faster for 1.3M files)."""
    stat, out = os.stat, []
    for path in paths:
        try:
            out.append(stat(path).st_ctime_ns)
        except OSError:
            out.append(None)
    return out


def ctime(path: str) -> int | None:
    try:
        return os.stat(path).st_ctime_ns
    except OSError:
        return None
