"""File-level helpers of the ssd backend: reading and mapping entry files, writers' temp names, per-entry
lock files, and telling key-named entry files from anything else in a cache folder."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import secrets
import socket
import time

import torch

from qie.cache.base import check_key
from qie.errors import StorageError

SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
LOCK_SUFFIX = ".lock"
# A temp file this old belongs to a writer that died (a put takes well under a second).
STALE_TEMP_SECONDS = 3600
# Files at least this big are mapped (private, copy-on-write) instead of read: `get` then costs no copy,
# the pages come straight from the page cache when first touched (usually by collate's own copy).
# Smaller files are read: one read is cheaper than mapping and unmapping.
MMAP_MIN_BYTES = 256 * 1024
# What a full or read-only disk looks like: reported as a StorageError, not a traceback.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)

_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


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


def read_head(path: str) -> tuple[bytes, int]:
    """(the 8-byte length and the safetensors header that follows, the file size): ~1 KB read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 4096, 0)
        need = 8 + int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
        if len(head) < need <= size:
            head = os.pread(fd, need, 0)
        return head, size
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


def write_atomic(path: str, data: bytes, key: str) -> None:
    """Write `data` to a temp file beside `path`, then rename it into place (readers never see half a file).

    Raises:
        StorageError: a full disk or a folder that cannot be written (naming it and what to do); the entry
            that was at `path` before, and every other entry, are kept.
    """
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
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            raise storage_error(e, folder, "writing a cache entry") from None
        raise


def write_small(path: str, text: str) -> bool:
    """Write a small file atomically, creating its folder; False (nothing raised) where that fails."""
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def storage_error(e: OSError, path: str | os.PathLike, doing: str) -> StorageError:
    """A StorageError for an OSError of a full or unwritable disk, naming the path and what to do."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        advice = "free space on that disk or point the setting at another one; what was written before is kept"
    else:
        advice = "fix the folder's permissions or point the setting at a writable folder"
    return StorageError(f"{e.strerror} while {doing} in {str(path)!r}: {advice}")


def temp_name(key: str, pid: int | None = None) -> str:
    """Name of a writer's temp file: host and pid tell `verify` whether its writer still runs."""
    return f".{key}.{_HOST}.{pid or os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


def entry_key(name: str) -> str | None:
    """The key of an entry file named `name` (`<key>.safetensors`), or None for any other file."""
    if not name.endswith(SUFFIX) or name.startswith("."):
        return None
    key = name[: -len(SUFFIX)]
    try:
        check_key(key)
    except ValueError:
        return None
    return key


def is_stale_temp(entry: os.DirEntry, now: float) -> bool:
    """A temp file whose writer is gone: dead on this host, or older than STALE_TEMP_SECONDS."""
    name = entry.name
    if not (name.startswith(".") and name.endswith(TEMP_SUFFIX)):
        return False
    parts = name[1 : -len(TEMP_SUFFIX)].rsplit(".", 3)
    if len(parts) != 4:
        return False
    try:
        check_key(parts[0])
    except ValueError:
        return False
    if parts[1] == _HOST and parts[2].isdigit() and not _pid_alive(int(parts[2])):
        return True
    try:
        return now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_SECONDS
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


def unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


class FileClaim:
    """An exclusive `flock` on a lock file; the system drops it if the holder dies."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd is None:
            return
        unlink(self.path)  # while still locked: a waiter that opened this file sees it is gone and retries
        os.close(self.fd)
        self.fd = None


def claim_file(path: str, wait: bool = False) -> FileClaim | None:
    """Lock `path` (created if missing): a FileClaim, or None when another process holds it (no `wait`)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            continue
        except OSError as e:
            if e.errno in STORAGE_ERRNOS:
                raise storage_error(e, os.path.dirname(path), "claiming a cache entry") from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        try:  # the previous holder unlinks the file on release: then lock the file now at the path
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return FileClaim(path, fd)
        os.close(fd)


def sweep_lock(entry: os.DirEntry) -> bool:
    """Remove a lock file nobody holds (its holder died); True if removed."""
    if not (entry.name.startswith(".") and entry.name.endswith(LOCK_SUFFIX)):
        return False
    claim = claim_file(entry.path)
    if claim is None:
        return False
    claim.release()
    return True


def now() -> float:
    return time.time()
