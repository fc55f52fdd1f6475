"""The `ssd` backend: one safetensors file per entry at `<dir>/<type>/<key[:2]>/<key>.safetensors`.

Admin actions (stats, clear, verify) look only at key-named entry files in real (not symlinked) type and
shard folders under `dir`, so they never reach outside it, and never create `dir`: only writers do.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import safetensors
import torch

from qie.cache import files, folders
from qie.cache.base import (
    CorruptEntry,
    CorruptError,
    Entry,
    EntryCounts,
    VerifyReport,
    base_of,
    check_entry,
    check_key,
    check_keys,
    check_meta,
    check_type,
    check_types,
    decode,
    empty_stats,
    encode,
)
from qie.cache.codec import Header, parse_header, quick_header
from qie.cache.documents import FolderDocuments
from qie.cache.files import MMAP_MIN_BYTES, SUFFIX, load_file, read_file, temp_name
from qie.errors import CacheDirMissing, ConfigError, StorageError

log = logging.getLogger(__name__)

__all__ = ["MMAP_MIN_BYTES", "STARTUP_CHECKS", "SsdBackend", "load_file", "read_file", "temp_name"]

STARTUP_CHECKS = ("folders", "files")


class SsdBackend:
    """Entries as safetensors files, written atomically (temp file + `os.replace`).

    Args:
        dir: the cache folder (`cache.dir`); writers create it (and its subfolders) on their first put.
        verify_reads: check every entry's checksum when it is read (`cache.verify_reads`).
        startup_check: how a whole set checked whole before is checked again (`cache.backend.startup_check`): "folders",
            one stat per type and shard folder its entries are in (an entry added, removed or replaced since
            makes it check file by file); "files", one stat per entry file, and a file changed since is read whole
            and its checksum checked, which also finds an entry rewritten in place (any byte of it) before the first
            step rather than when it is read.

    Raises:
        ConfigError: when `dir` is not set, or `startup_check` is neither.
    """

    stores = True
    persists = True
    remote_reads = False

    def __init__(
        self, dir: str | os.PathLike | None = None, verify_reads: bool = False, startup_check: str = "folders"
    ) -> None:
        if dir is None or str(dir) == "":
            raise ConfigError("cache.dir is not set: pass cache.dir=/path/to/cache for the ssd backend")
        if startup_check not in STARTUP_CHECKS:
            raise ConfigError(
                f"cache.backend.startup_check={startup_check!r}: expected one of {', '.join(STARTUP_CHECKS)}"
            )
        self.startup_check = startup_check
        self.root = Path(dir).expanduser().absolute()
        self.shared = FolderDocuments(self.root)  # the failure list, beside the entries
        self._root = str(self.root)
        self.verify_reads = bool(verify_reads)

    def __repr__(self) -> str:
        return f"SsdBackend(dir={self._root!r})"

    def path(self, type: str, key: str) -> Path:
        """Where the entry (type, key) lives, whether or not it exists."""
        return Path(self._path(check_type(type), check_key(key)))

    def _path(self, type: str, key: str) -> str:
        return f"{self._root}/{type}/{key[:2]}/{key}{SUFFIX}"

    def get(self, type: str, key: str) -> Entry | None:
        """The entry, or None on a miss or an unreadable file (logged as a warning)."""
        path = self._path(check_type(type), check_key(key))
        try:
            return decode(load_file(path), type, verify=self.verify_reads, key=key)
        except FileNotFoundError:
            return None
        except (OSError, CorruptError) as e:
            log.warning("cache entry %s is unreadable (%s); treating it as a miss", path, e)
            return None

    def put(self, type: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> int:
        """Write the entry atomically, in the tensors' own dtypes; returns the bytes written.

        Raises:
            StorageError: the disk is full or the folder cannot be written (entries already there are kept).
        """
        path = self._path(check_type(type), check_key(key))
        check_entry(tensors)
        data = encode(tensors, type, check_meta(meta), key)
        files.write_atomic(path, data, key)
        return len(data)

    def exists(self, type: str, key: str) -> bool:
        """Whether a file is stored for (type, key); its content is not checked."""
        return os.path.isfile(self._path(check_type(type), check_key(key)))

    def intact(self, type: str, key: str) -> bool:
        """Whether the entry's header is whole and its base (if any) is stored with the recorded checksum."""
        return self._intact(check_type(type), check_key(key), {})

    def intact_all(self, items: Sequence[tuple[str, str]], remember: bool = False) -> list[bool]:
        """`intact` of each entry. A stamp per set of entries (`.checked/<token>`) records a time before which
        every file of the set that existed was whole: while no file of the set was changed or written since
        (the kernel sets a file's ctime on every change, and no tool can set it back), the check is one stat
        per folder of the set (`startup_check="folders"`) or per file. With `remember`, a check that found
        every existing entry whole writes the stamp."""
        # Samples share entries (the prompts of one image pair share its latents): each file is looked at once.
        counts = EntryCounts.of(Counter(items))
        ok = self._intact_counted(counts, remember)
        if all(ok):
            return [True] * len(items)
        found = dict(zip(counts, ok))
        return [found[item] for item in items]

    def intact_counted(self, counts: Mapping[tuple[str, str], int], remember: bool = False) -> bool:
        """Whether every entry `counts` counts is intact: `all(intact_all(items))` for the items it counts (the
        same stamp), without the list of items (a million samples name four million entries); an `EntryCounts`
        is taken type by type, without a tuple per entry."""
        return all(self._intact_counted(EntryCounts.of(counts), remember))

    def _intact_counted(self, counts: EntryCounts, remember: bool) -> list[bool]:
        """`intact` of each entry of `counts`, in its order (see `intact_all`)."""
        by_type = counts.by_type()
        for t in by_type:
            check_type(t)
        if not counts.hex_keys:
            check_keys([k for keys, _, _ in by_type.values() for k in keys])
        stamp = f"{self._root}/.checked/{folders.counted_token(counts)}"
        # The stamp's time is read from the clock that sets the entries' ctimes (the file system's own, which
        # may be another machine's): a file created now tells it.
        start = folders.file_system_now(f"{self._root}/.checked") if remember and os.path.isdir(self._root) else None
        since, flags = folders.read_stamp(stamp)
        if folders.KEYED not in flags:  # a stamp of before headers named their keys: the set is checked once
            since = None
        keys = {t: type_keys for t, (type_keys, _, _) in by_type.items()}
        by_folders = self.startup_check == "folders"
        if since is not None and by_folders and "folders" in flags:
            found = folders.unchanged_entries(self._root, keys, since, "all" in flags)
            if found is not None:
                if remember and "all" not in flags and all(found):  # the same files as then: all there then too
                    files.write_small(stamp, folders.stamp_text(since, flags | {"all"}))
                return found
        ctimes = folders.ctimes([p for t, type_keys in keys.items() for p in self._paths(t, type_keys)])
        if since is not None and all(c is None or c < since for c in ctimes):
            if remember and by_folders and "folders" not in flags:  # a stamp of before: say what it did not
                files.write_small(stamp, folders.stamp_text(since, self._flags(keys, ctimes, None not in ctimes)))
            return [c is not None for c in ctimes]
        memo: dict[tuple[str, str], tuple[str, dict] | None] = {}
        ok = [c is not None and self._intact(t, k, memo) for (t, k), c in zip(counts, ctimes)]
        if since is not None and not by_folders:  # changed since the last check: its bytes are read and checked too
            ok = [good and (c < since or self._verified(t, k)) for (t, k), good, c in zip(counts, ok, ctimes)]
        if start is not None and any(ok) and all(good or c is None for good, c in zip(ok, ctimes)):
            files.write_small(stamp, folders.stamp_text(start, self._flags(keys, ctimes, all(ok))))
        return ok

    def _flags(self, keys: dict[str, list[str]], ctimes: list[int | None], all_exist: bool) -> set[str]:
        """What a stamp of the set says besides its time (see `folders.read_stamp`)."""
        flags = {"all", folders.KEYED} if all_exist else {folders.KEYED}
        if self.startup_check == "folders" and folders.folder_times_kept(self._root, keys, ctimes):
            flags.add("folders")
        return flags

    def _paths(self, type: str, keys: list[str]) -> list[str]:
        """The entry files of `keys` of `type` (one string each, the folder's part made once)."""
        folder = f"{self._root}/{type}/"
        return [f"{folder}{k[:2]}/{k}{SUFFIX}" for k in keys]

    def _intact(self, type: str, key: str, memo: dict) -> bool:
        if (type, key) not in memo:
            memo[type, key] = self._quick(type, key)
        found = memo[type, key]
        if found is None:
            return False
        base = base_of(found[1])
        if base is None:
            return True
        try:
            return self._intact(check_type(base[0]), check_key(base[1]), memo) and memo[base[:2]][0] == base[2]
        except ValueError:
            return False

    def _verified(self, type: str, key: str) -> bool:
        """Whether the entry file reads back whole, its tensor bytes matching their checksum."""
        try:
            decode(read_file(self._path(type, key)), type, verify=True, key=key)
        except (OSError, CorruptError):
            return False
        return True

    def _quick(self, type: str, key: str) -> tuple[str, dict] | None:
        try:
            head, size = files.read_head(self._path(type, key))
        except OSError:
            return None
        return quick_header(head, size, type, key)

    def claim(self, type: str, key: str, wait: bool = False) -> files.FileClaim | None:
        """Lock (type, key) with a lock file beside its entry (`.<key>.lock`)."""
        path = self._path(check_type(type), check_key(key))
        return files.claim_file(f"{os.path.dirname(path)}/.{key}{files.LOCK_SUFFIX}", wait)

    def sweep_temp(self) -> int:
        """Remove temp files of writers that died and lock files nobody holds; returns how many."""
        removed, now = 0, files.now()
        for type in folders.real_types(self._root, check_types(None)):
            for entry in folders.scan(self._root, type):
                if files.is_stale_temp(entry, now):
                    removed += files.unlink(entry.path)
                elif files.sweep_lock(entry):
                    removed += 1
        return removed

    def check_access(self, write: bool = False) -> None:
        """Raise StorageError when `dir` is a file, missing (readers) or not writable (writers); a writer's
        check creates `dir`."""
        root = self._root
        if os.path.exists(root) and not os.path.isdir(root):
            raise StorageError(f"cache.dir {root!r} is a file, not a folder: point cache.dir at a folder")
        if not write:
            if not os.path.isdir(root):
                raise CacheDirMissing(
                    f"cache.dir {root!r} does not exist (nothing was created): check the path, or fill it with "
                    "python -m qie.precompute"
                )
            return
        probe = f"{root}/{temp_name('access-check')}"
        try:
            os.makedirs(root, exist_ok=True)
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(probe)
        except OSError as e:
            if e.errno not in files.STORAGE_ERRNOS:
                raise
            raise StorageError(
                f"cache.dir {root!r} is not writable ({e.strerror}): fix its permissions or point cache.dir at "
                "a writable folder"
            ) from None

    def keys(self, type: str) -> list[str]:
        """The keys of the entry files of `type` (in real type and shard folders), sorted (sync lists them)."""
        root, types = self._root, [check_type(type)]
        found = (folders.shard_key(e) for t in folders.real_types(root, types) for e in folders.scan(root, t))
        return sorted(k for k in found if k is not None)

    def stats(self, types: Iterable[str] | None = None) -> dict[str, dict]:
        """{type: {"count", "bytes"}} of the entry files (temp and lock files excluded)."""
        out = empty_stats(types)
        self.check_access()
        for type in folders.real_types(self._root, out):
            s = out[type]
            for entry in (e for e in folders.scan(self._root, type) if folders.shard_key(e) is not None):
                try:
                    s["bytes"] += entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
                s["count"] += 1
        return out

    def clear(self, types: Iterable[str] | None = None) -> int:
        """Remove every entry of `types` (and stale temp files); returns the entries removed."""
        wanted = check_types(types)
        self.check_access()
        removed, now = 0, files.now()
        for type in folders.real_types(self._root, wanted):
            for entry in folders.scan(self._root, type):
                if folders.shard_key(entry) is not None:
                    removed += files.unlink(entry.path)
                elif files.is_stale_temp(entry, now):
                    files.unlink(entry.path)
            folders.remove_empty_dirs(self._root, type)
        return removed

    def verify(self, types: Iterable[str] | None = None, fix: bool = False) -> VerifyReport:
        """Read every entry back and check it (checksum included); with `fix`, delete the corrupt ones and
        stale temp files."""
        wanted = check_types(types)
        self.check_access()
        report, now = VerifyReport(), files.now()
        for type in folders.real_types(self._root, wanted, report):
            for entry in folders.scan(self._root, type):
                if files.is_stale_temp(entry, now):
                    report.stale_temp.append(entry.path)
                    if fix and files.unlink(entry.path):
                        report.temp_removed += 1
                key = files.entry_key(entry.name)
                if key is None:
                    continue  # not an entry: never touched
                report.checked += 1
                if folders.shard_key(entry) is None:  # key-named, but not ours to delete: another folder's name
                    reason = f"misplaced: belongs in folder {key[:2]}/ (left in place: move or delete it)"
                    report.corrupt.append(CorruptEntry(type, key, entry.path, reason))
                    continue
                reason = self._check_file(entry, type, key)
                if reason is not None:
                    report.corrupt.append(CorruptEntry(type, key, entry.path, reason))
                    if fix and files.unlink(entry.path):
                        report.removed += 1
        return report

    def unused(
        self, keep: Mapping[str, set[str]], types: Iterable[str] | None = None, remove: bool = False
    ) -> dict[str, dict]:
        """The entries of `types` no kept entry needs (see the protocol); deleted with `remove`. Only key-named
        entry files in real type and shard folders of `dir` are looked at."""
        wanted = check_types(types)
        self.check_access()
        kept = {t: set(keep.get(t, ())) for t in check_types(None)}
        for type, key in [(t, k) for t, ks in kept.items() for k in ks]:  # a prompt entry keeps its base
            head = self._header(type, key) if files.entry_key(key + SUFFIX) else None
            base = base_of(head.meta) if head is not None else None
            if base is not None and base[0] in kept:
                kept[base[0]].add(base[1])
        out = empty_stats(wanted)
        for type in folders.real_types(self._root, wanted):
            for entry in folders.scan(self._root, type):
                key = folders.shard_key(entry)
                if key is None or key in kept[type]:
                    continue
                try:
                    size = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
                if remove and not files.unlink(entry.path):
                    continue
                out[type]["count"] += 1
                out[type]["bytes"] += size
            if remove:
                folders.remove_empty_dirs(self._root, type)
        return out

    def _header(self, type: str, key: str) -> Header | None:
        try:
            head, size = files.read_head(self._path(type, key))
            return parse_header(head, size, type, key)
        except (OSError, CorruptError):
            return None

    def _base_problem(self, head: Header) -> str | None:
        """Why the base this entry extends is not usable, or None (also for an entry without a base)."""
        base = base_of(head.meta)
        if base is None:
            return None
        type, key, digest = base
        try:
            found = self._header(check_type(type), check_key(key))
        except ValueError:
            return f"names a bad base entry {type}/{key}"
        if found is None:
            return f"its base entry {type}/{key} is missing or damaged"
        if found.checksum != digest:
            return f"its base entry {type}/{key} was rewritten (checksum {found.checksum}, recorded {digest})"
        return None

    def _check_file(self, entry: os.DirEntry, type: str, key: str) -> str | None:
        """Why the file is not a good entry of `type` under `key`, or None if it is."""
        try:
            buf = read_file(entry.path)
            decode(buf, type, verify=True, key=key)
            safetensors.deserialize(buf.numpy().tobytes())  # the library itself must accept it too
            head, size = files.read_head(entry.path)
            return self._base_problem(parse_header(head, size, type, key))
        except CorruptError as e:
            return str(e)
        except Exception as e:  # any failure to read back makes it corrupt
            return f"{e.__class__.__name__}: {e}"
