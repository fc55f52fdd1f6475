"""The stages' shared documents (`qie.cache.base.Documents`: the precompute failure list) as files of a folder, for
a backend whose entries are files there (`cache=ssd`, and a folder backend of your own): each document is written
atomically (`qie.cache.files.write_atomic`) while its writer holds the document's lock file (`claim_file`), so
processes on one machine or one shared file system merge their changes. The other kinds: `ProcessDocuments`
(`qie.cache.base`, this process only) and `qie.cache.remote_shared.SharedDocuments` (an object store).
"""

from __future__ import annotations

import os
from pathlib import Path

from qie.cache.base import Change
from qie.cache.files import LOCK_SUFFIX, claim_file, write_atomic


class FolderDocuments:
    """Documents as files of `folder` (created on the first write); `.<name>.lock` is held while one is rewritten."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)

    def __repr__(self) -> str:
        return f"FolderDocuments({str(self.folder)!r})"

    def read(self, name: str) -> bytes | None:
        try:
            return (self.folder / name).read_bytes()
        except FileNotFoundError:
            return None

    def update(self, name: str, change: Change) -> None:
        lock = claim_file(str(self.folder / f".{name}{LOCK_SUFFIX}"), wait=True)
        try:
            data = change(self.read(name))
            if data is not None:
                write_atomic(str(self.folder / name), data, name)
        finally:
            lock.release()


__all__ = ["FolderDocuments"]
