"""Cache keys: hashes of file contents (remembered by stat), of text, and of all an entry depends on."""

from __future__ import annotations

import fcntl
import gc
import hashlib
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from qie.cache.base import SCHEMA_VERSION, check_type

log = logging.getLogger(__name__)

# JSON columns: paths, then per file its stat signature [size, mtime_ns, ctime_ns, inode] and its hash.
_INDEX_FORMAT = "qie-file-hashes/2"
Signature = tuple[int, int, int, int]


def signature(st: os.stat_result) -> Signature:
    """What says a file is unchanged: size, mtime_ns, ctime_ns and inode. Tools that keep the mtime of a
    replaced file (`cp -p`, `rsync -t`, tar) cannot keep its ctime: the kernel sets it on every change."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


class FileHasher:
    """Digests of files' bytes, remembered against (absolute path, size, mtime_ns, ctime_ns, inode).

    A file whose signature is unchanged is not read again, so a warm start costs one stat per file.
    With `index_path`, what is remembered persists across processes as JSON (see `save`).

    Args:
        index_path: JSON index file; None keeps the memory in this object only.
        algorithm: "sha256" (images), or "xxh3_128" (model weights: ~10x faster, for change detection).
    """

    @classmethod
    def in_folder(cls, folder: str | os.PathLike | None) -> FileHasher:
        """The image-hash index the stages keep in their state folder (`cache.state_dir`); in memory without one."""
        return cls(Path(folder) / "file_hashes.json" if folder else None)

    def __init__(self, index_path: str | os.PathLike | None = None, algorithm: str = "sha256") -> None:
        self.index_path = Path(index_path) if index_path is not None else None
        self.algorithm = algorithm
        # Read on first use: a start whose sample keys are all remembered (KeyMemo) never needs it.
        self._index: dict[str, tuple[Signature, str]] | None = None if self.index_path else {}
        self._dirty: set[str] = set()
        self.files_read = 0  # files hashed from their bytes in this object's lifetime

    @property
    def _entries(self) -> dict[str, tuple[Signature, str]]:
        if self._index is None:
            self._index = _read_index(self.index_path)
        return self._index

    @_entries.setter
    def _entries(self, value: dict[str, tuple[Signature, str]]) -> None:
        self._index = value

    def __len__(self) -> int:
        return len(self._entries)

    def hash(self, path: str | os.PathLike) -> str:
        """The hex digest of the file's bytes.

        Raises:
            OSError: when the file cannot be stat'ed or read.
        """
        p = os.path.abspath(path)
        sig = signature(os.stat(p))
        known = self._entries.get(p)
        if known is not None and known[0] == sig:
            return known[1]
        with open(p, "rb") as f:
            digest = _digest(f, self.algorithm)
        self.files_read += 1
        # A file rewritten while we read it keeps no memory: its next lookup reads it again.
        if signature(os.stat(p)) == sig:
            self._entries[p] = (sig, digest)
            self._dirty.add(p)
        return digest

    def save(self) -> None:
        """Write the index atomically, merged with what other processes saved meanwhile.

        Runs read-merge-write under an exclusive lock on `<index>.lock`; for a path both know, the hash
        computed here wins. No-op without `index_path` or when nothing new was hashed.
        """
        if self.index_path is None or not self._dirty:
            return
        index = self.index_path
        index.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{index}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                merged = _read_index(index)
                merged.update((p, self._entries[p]) for p in self._dirty)
                _write_index(index, merged)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        self._entries = merged
        self._dirty.clear()


def _digest(f, algorithm: str) -> str:
    if algorithm == "sha256":
        return hashlib.file_digest(f, "sha256").hexdigest()
    if algorithm == "xxh3_128":
        import xxhash

        h, buf = xxhash.xxh3_128(), bytearray(1 << 24)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
        return h.hexdigest()
    raise ValueError(f"unknown file hash algorithm {algorithm!r}: sha256 or xxh3_128")


def _read_index(path: Path) -> dict[str, tuple[Signature, str]]:
    """The index's entries; an unreadable index is logged and treated as empty (it is only a speed-up)."""
    # Columns (not one list per file) and no GC passes while parsing: 100k entries load in ~0.1 s.
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        with open(path, "rb") as f:
            doc = json.load(f)
        if doc["format"] != _INDEX_FORMAT:
            raise ValueError(f"unknown format {doc['format']!r}")
        paths, sigs, hashes = doc["paths"], doc["signatures"], doc["hashes"]
        if not len(paths) == len(sigs) == len(hashes):
            raise ValueError("columns differ in length")
        return dict(zip(paths, zip(map(tuple, sigs), hashes)))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("file hash index %s is unreadable (%s); starting without it", path, e)
        return {}
    finally:
        if gc_was_on:
            gc.enable()


def _write_index(path: Path, entries: dict[str, tuple[Signature, str]]) -> None:
    """Write the index atomically: a temp file in the same folder, then os.replace."""
    doc = {
        "format": _INDEX_FORMAT,
        "paths": list(entries),
        "signatures": [list(e[0]) for e in entries.values()],
        "hashes": [e[1] for e in entries.values()],
    }
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def entry_key(type: str, fields: dict[str, Any]) -> str:
    """The key of a cache entry: sha256 of canonical JSON of the schema version, the type and `fields`.

    Args:
        type: a cache type.
        fields: everything the entry's value depends on (image hashes, sizes, model fingerprints, prompt
            text...), as JSON values; the caller decides what belongs here.

    Raises:
        ValueError: for an unknown type, or a field named "schema" or "type".
        TypeError: for a field value JSON cannot represent.
    """
    check_type(type)
    clash = {"schema", "type"} & fields.keys()
    if clash:
        raise ValueError(f"entry_key fields may not be named {sorted(clash)}: those are set by the cache")
    doc = {"schema": SCHEMA_VERSION, "type": type, **fields}
    text = json.dumps(
        doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_not_json
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _not_json(value: Any) -> Any:
    raise TypeError(
        f"entry_key field value {value!r} ({type(value).__name__}) is not a JSON value: "
        "pass str, int, float, bool, None, lists or dicts of them"
    )
