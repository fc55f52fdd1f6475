"""The node-local copy of a remote cache: entry files under `local_dir` (the ssd layout), at most `max_bytes` of
them, the least recently used evicted first.

Files are written atomically (temp name + `os.replace`), so a reader never sees half a file; several processes
of one node may share the folder (each evicts by what it sees; a file another process removed is a miss). A
full disk evicts and tries again, and when that is not enough the entry is simply not kept: never an error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from qie.cache import files, folders
from qie.cache.files import SUFFIX, load_file

log = logging.getLogger(__name__)


def default_local_dir(url: str, endpoint_url: str | None) -> Path:
    """`$QIE_HOME/remote/<hash of url and endpoint>`: one local copy per remote cache."""
    home = Path(os.environ.get("QIE_HOME") or Path.home() / ".cache" / "qie")
    return home / "remote" / hashlib.sha256(f"{endpoint_url or ''} {url}".encode()).hexdigest()[:16]


class LocalCopy:
    """Entry files by (type, key) under `root`, with least-recently-used eviction past `max_bytes`.

    Args:
        root: the folder (created on the first write).
        max_bytes: the most the entry files may take; None or 0: no limit.
    """

    def __init__(self, root: str | os.PathLike, max_bytes: int | None = None) -> None:
        self.root = Path(root).expanduser().absolute()
        self.max_bytes = int(max_bytes) if max_bytes else None
        self._sizes: OrderedDict[str, int] = OrderedDict()  # path -> size, least recently used first
        self._total = 0
        self._lock = threading.Lock()
        self._scanned = False  # the folder is scanned on the first write under a limit (readers never scan)

    def path(self, type: str, key: str) -> str:
        return f"{self.root}/{type}/{key[:2]}/{key}{SUFFIX}"

    @property
    def total_bytes(self) -> int:
        self._scan()
        return self._total

    def _scan(self) -> None:
        """Learn what earlier processes left, oldest use (mtime) first (once)."""
        if self._scanned:
            return
        self._scanned = True
        found = []
        for p in self.root.glob(f"*/*/*{SUFFIX}") if self.root.is_dir() else ():
            try:
                st = p.stat()
            except OSError:
                continue
            found.append((st.st_mtime_ns, str(p), st.st_size))
        for _, p, size in sorted(found):
            self._sizes[p] = size
            self._total += size

    def read(self, type: str, key: str) -> torch.Tensor | None:
        """The entry file's bytes, or None when this node holds no copy; marks it recently used."""
        path = self.path(type, key)
        try:
            buf = load_file(path)
        except OSError:
            self._forget(path)
            return None
        with self._lock:
            if path in self._sizes:
                self._sizes.move_to_end(path)
            elif self._scanned:
                self._sizes[path] = len(buf)
                self._total += len(buf)
        try:
            os.utime(path)  # the use survives this process: the next one's scan orders by it
        except OSError:
            pass
        return buf

    def has(self, type: str, key: str) -> bool:
        return os.path.isfile(self.path(type, key))

    def write(self, type: str, key: str, data: bytes) -> bool:
        """Keep `data` as the entry's copy, evicting older copies to stay within `max_bytes`; False when it
        could not be kept (larger than the limit, or the disk stayed full)."""
        size = len(data)
        if self.max_bytes is not None and size > self.max_bytes:
            return False
        path = self.path(type, key)
        if self.max_bytes is not None:
            self._scan()
            self.evict(size, keep=path)
        for attempt in range(2):
            try:
                files.write_atomic(path, data, key)
                break
            except Exception as e:  # a full or unwritable disk: make room once, then give up quietly
                if attempt or not self._sizes:
                    log.warning("the local cache copy %s cannot be written (%s); reading from the store", path, e)
                    return False
                self._scan()
                self.evict(self._total // 2 + size, keep=path, full=True)
        with self._lock:
            self._total += size - self._sizes.pop(path, 0)
            self._sizes[path] = size
        return True

    def evict(self, room: int, keep: str | None = None, full: bool = False) -> int:
        """Remove least recently used copies until `room` more bytes fit (with `full`: until `room` bytes are
        freed); returns the bytes freed."""
        freed = 0
        while True:
            with self._lock:
                if full:
                    done = freed >= room
                else:
                    done = self.max_bytes is None or self._total + room <= self.max_bytes
                victims = [p for p in self._sizes if p != keep][:1]
                if done or not victims:
                    return freed
                size = self._sizes.pop(victims[0])
                self._total -= size
            freed += size
            try:
                os.unlink(victims[0])
            except OSError:
                pass

    def sweep_temp(self, types: list[str]) -> int:
        """Remove temp files of writers of this copy that died; returns how many."""
        removed, now = 0, files.now()
        for type in folders.real_types(str(self.root), types):
            for entry in folders.scan(str(self.root), type):
                if files.is_stale_temp(entry, now):
                    removed += files.unlink(entry.path)
        return removed

    def drop(self, type: str, key: str) -> None:
        """Remove this node's copy (a copy that failed its check, or an entry removed from the store)."""
        path = self.path(type, key)
        self._forget(path)
        try:
            os.unlink(path)
        except OSError:
            pass

    def _forget(self, path: str) -> None:
        with self._lock:
            self._total -= self._sizes.pop(path, 0)
