"""Errors a user can act on. The CLI prints their message, without a traceback, and exits 2."""

from __future__ import annotations

import errno
import os
import secrets
import signal
from pathlib import Path


class QieError(Exception):
    """Base class: the message names the file or key at fault and says what to do."""


class ConfigError(QieError):
    """A config key or value that cannot work."""


class DataError(QieError):
    """A data set input (image, caption, manifest row) that cannot be read."""


class CacheMissError(QieError):
    """Cached mode needs an entry the cache does not hold."""


class ModelLoadError(QieError):
    """A model part, LoRA or checkpoint that cannot be loaded."""


class StorageError(QieError):
    """A folder or file qie must read or write is not usable: missing, a file, not writable, disk full."""


class CacheDirMissing(StorageError):
    """The cache folder a reader needs does not exist (to training: every entry is missing)."""


class PluginError(QieError):
    """User code a `_target_` names (an objective, a reward, a plug-in module) raised, or returned what its protocol
    does not allow: the message names the component, its `_target_` and what it did."""


class Interrupted(KeyboardInterrupt):
    """A stop signal a stage could not end cleanly on (a second signal before training's stop save finished): its
    message says what was kept. The CLI prints it in one line and exits 128 + the signal."""

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = int(signum)


def raised_at(e: BaseException) -> str:
    """` (at FILE:LINE)` of where `e` was raised: the innermost frame of its traceback outside the Python libraries
    (the user's or qie's own code, not torch's), else the innermost; "" without a traceback."""
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    if not frames:
        return ""
    own = [f for f in frames if "site-packages" not in f[0] and "/lib/python" not in f[0]]
    file, line = (own or frames)[-1]
    return f" (at {file}:{line})"


def describe_os_error(e: OSError) -> str:
    """One line for an OSError of the disk: what happened, the path, and what to do."""
    where = f" ({e.filename})" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{e.strerror}{where}: free space on that disk or point the output elsewhere; what was saved is kept"
    return f"{e.strerror}{where}: fix the permissions of that path or point the setting at a writable folder"


def check_writable(folder: Path, what: str) -> None:
    """Create `folder` if needed and write a probe file in it.

    Raises:
        StorageError: naming `what` and the folder, when it is a file or cannot be created or written.
    """
    probe = folder / f".qie-write-check.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        if isinstance(e, FileExistsError) or e.errno == errno.ENOTDIR:
            raise StorageError(f"{what} {str(folder)!r} is a file (or lies under one): choose a folder") from None
        raise StorageError(f"{what} {str(folder)!r} is not writable ({e.strerror}): {describe_os_error(e)}") from None
