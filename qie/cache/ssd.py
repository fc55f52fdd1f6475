"""The `ssd` backend: one safetensors file per entry at `<dir>/<type>/<key[:2]>/<key>.safetensors`."""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import secrets
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import safetensors
import torch

from qie.cache.base import (
    CorruptEntry,
    CorruptError,
    Entry,
    VerifyReport,
    check_key,
    check_type,
    check_types,
    decode,
    empty_stats,
    encode,
)
from qie.errors import ConfigError

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
# A temp file this old belongs to a writer that died (a put takes well under a second).
STALE_TEMP_SECONDS = 3600
# Files at least this big are mapped (private, copy-on-write) instead of read: `get` then costs no copy,
# the pages come straight from the page cache when first touched (usually by collate's own copy).
# Smaller files are read: one read is cheaper than mapping and unmapping.
MMAP_MIN_BYTES = 256 * 1024

_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


class SsdBackend:
    """Entries as safetensors files, written atomically (temp file + `os.replace`).

    Args:
        dir: the cache folder (`cache.dir`); created if missing, its subfolders on first put.

    Raises:
        ConfigError: when `dir` is not set.
    """

    def __init__(self, dir: str | os.PathLike | None = None) -> None:
        if dir is None or str(dir) == "":
            raise ConfigError("cache.dir is not set: pass cache.dir=/path/to/cache for the ssd backend")
        self.root = Path(dir).expanduser().absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self._root = str(self.root)

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
            return decode(load_file(path), type)
        except FileNotFoundError:
            return None
        except (OSError, CorruptError) as e:
            log.warning("cache entry %s is unreadable (%s); treating it as a miss", path, e)
            return None

    def put(self, type: str, key: str, tensors: Entry) -> int:
        """Write the entry atomically, in the tensors' own dtypes; returns the bytes written."""
        path = self._path(check_type(type), check_key(key))
        data = encode(tensors, type)
        folder = os.path.dirname(path)
        tmp = f"{folder}/{temp_name(key)}"
        try:
            try:
                f = open(tmp, "wb")
            except FileNotFoundError:
                os.makedirs(folder, exist_ok=True)
                f = open(tmp, "wb")
            with f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return len(data)

    def exists(self, type: str, key: str) -> bool:
        """Whether a file is stored for (type, key); its content is not checked."""
        return os.path.isfile(self._path(check_type(type), check_key(key)))

    def stats(self, types: Iterable[str] | None = None) -> dict[str, dict]:
        """{type: {"count", "bytes"}} of the entry files (temp files excluded)."""
        out = empty_stats(types)
        for type, s in out.items():
            for entry in self._scan(type):
                if _is_entry(entry.name):
                    try:
                        s["bytes"] += entry.stat().st_size
                    except FileNotFoundError:
                        continue
                    s["count"] += 1
        return out

    def clear(self, types: Iterable[str] | None = None) -> int:
        """Remove every entry of `types` (and stale temp files); returns the entries removed."""
        removed = 0
        now = time.time()
        for type in check_types(types):
            for entry in self._scan(type):
                if _is_entry(entry.name) or _is_stale_temp(entry, now):
                    try:
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        continue
                    removed += int(_is_entry(entry.name))
            self._remove_empty_dirs(type)
        return removed

    def verify(self, types: Iterable[str] | None = None, fix: bool = False) -> VerifyReport:
        """Read every entry back and check it; with `fix`, delete the corrupt ones and stale temp files."""
        report = VerifyReport()
        now = time.time()
        for type in check_types(types):
            for entry in self._scan(type):
                if _is_stale_temp(entry, now):
                    report.stale_temp.append(entry.path)
                    if fix and _unlink(entry.path):
                        report.temp_removed += 1
                if not _is_entry(entry.name):
                    continue
                report.checked += 1
                key = entry.name[: -len(SUFFIX)]
                reason = _check_file(entry.path, type, key)
                if reason is not None:
                    report.corrupt.append(CorruptEntry(type, key, entry.path, reason))
                    if fix and _unlink(entry.path):
                        report.removed += 1
        return report

    def _scan(self, type: str) -> Iterator[os.DirEntry]:
        """Files in the shard folders of `type`, via os.scandir (no per-file stat)."""
        try:
            shards = [e for e in os.scandir(f"{self._root}/{type}") if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return
        for shard in shards:
            try:
                with os.scandir(shard.path) as it:
                    yield from (e for e in it if e.is_file(follow_symlinks=False))
            except FileNotFoundError:
                continue

    def _remove_empty_dirs(self, type: str) -> None:
        folder = f"{self._root}/{type}"
        try:
            shards = list(os.scandir(folder))
        except FileNotFoundError:
            return
        for path in [d.path for d in shards] + [folder]:
            try:
                os.rmdir(path)
            except OSError:
                pass  # not empty, or a writer just used it


def load_file(path: str | os.PathLike, mmap_min_bytes: int | None = None) -> torch.Tensor:
    """The whole file as a uint8 tensor: mapped privately when it has `mmap_min_bytes` (default
    `MMAP_MIN_BYTES`) or more, else read.

    A mapped file is copy-on-write (writing to the tensors never reaches the file) and stays valid when
    the entry is replaced or removed meanwhile: writers replace files atomically, never in place.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size >= (MMAP_MIN_BYTES if mmap_min_bytes is None else mmap_min_bytes) and size > 0:
            try:
                mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError):  # a file system that cannot map: read instead
                pass
            else:
                return torch.frombuffer(mapped, dtype=torch.uint8)  # the tensor keeps the mapping alive
        return _read_fd(fd, size)
    finally:
        os.close(fd)


def read_file(path: str | os.PathLike) -> torch.Tensor:
    """The whole file in one uint8 tensor, read straight into it (no intermediate `bytes`)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return _read_fd(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _read_fd(fd: int, size: int) -> torch.Tensor:
    buf = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    pos = 0
    while pos < size:
        n = os.readv(fd, [view[pos:]])
        if not n:
            break
        pos += n
    return buf[:pos] if pos < size else buf


def temp_name(key: str, pid: int | None = None) -> str:
    """Name of a writer's temp file: host and pid tell `verify` whether its writer still runs."""
    return f".{key}.{_HOST}.{pid or os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


def _check_file(path: str, type: str, key: str) -> str | None:
    """Why the file at `path` is not a good entry of `type` under `key`, or None if it is."""
    try:
        check_key(key)
    except ValueError:
        return "file name is not a cache key"
    if os.path.basename(os.path.dirname(path)) != key[:2]:
        return f"misplaced: belongs in folder {key[:2]}/"
    try:
        buf = read_file(path)
        decode(buf, type)
        safetensors.deserialize(buf.numpy().tobytes())  # the library itself must accept it too
    except CorruptError as e:
        return str(e)
    except Exception as e:  # any failure to read back makes it corrupt
        return f"{e.__class__.__name__}: {e}"
    return None


def _is_entry(name: str) -> bool:
    return name.endswith(SUFFIX) and not name.startswith(".")


def _is_stale_temp(entry: os.DirEntry, now: float) -> bool:
    """A temp file whose writer is gone: dead on this host, or older than STALE_TEMP_SECONDS."""
    name = entry.name
    if not (name.startswith(".") and name.endswith(TEMP_SUFFIX)):
        return False
    parts = name[1 : -len(TEMP_SUFFIX)].rsplit(".", 3)
    if len(parts) == 4 and parts[1] == _HOST and parts[2].isdigit() and not _pid_alive(int(parts[2])):
        return True
    try:
        return now - entry.stat().st_mtime > STALE_TEMP_SECONDS
    except FileNotFoundError:
        return False


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
