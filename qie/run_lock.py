"""One writer per run folder: an OS lock (`flock`) on `<run folder>/.qie-run.lock`, held while a training (or an
inference) runs.

The kernel drops the lock when its process ends, however it ends (a kill -9 included), so a lock is never
stale. The holder writes who it is (pid, host, start time) into the file, so a refused process can name it.
Only the writing process of a data-parallel run (rank 0) takes it; the others write nothing there.
A process may take the lock of one folder more than once (the entry point, then `train.run`).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
from pathlib import Path

from qie.errors import StorageError

LOCK_FILE = ".qie-run.lock"
# Folders this process holds: real path -> (file descriptor, how many holds).
_HELD: dict[str, list[int]] = {}


def is_writer() -> bool:
    """Whether this process writes the run folder: rank 0 of torchrun / accelerate launch, or a lone process."""
    return int(os.environ.get("RANK", "0") or 0) == 0


def acquire(folder: Path) -> None:
    """Hold the run folder `folder` for this process (created if needed).

    Raises:
        StorageError: another process holds it (naming its pid, host and start time).
    """
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(folder)
    if key in _HELD:
        _HELD[key][1] += 1
        return
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise StorageError(
            f"cannot open the run lock {str(folder / LOCK_FILE)!r} ({e.strerror}): it must be a "
            "file qie may write; remove what is there, or give this run its own hydra.run.dir"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _read_holder(fd)
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        raise StorageError(
            f"run folder {str(folder)!r} is in use by another training or inference ({holder}): two runs writing "
            "one folder would mix their records, metrics and checkpoints. Wait for it to end, or give this run its "
            "own hydra.run.dir"
        ) from None
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    _HELD[key] = [fd, 1]


def release(folder: Path) -> None:
    """Give up one hold of `folder`; the lock goes with the last."""
    key = os.path.realpath(folder)
    held = _HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        del _HELD[key]
        os.close(held[0])  # closing the descriptor drops the flock


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said who it is yet"
