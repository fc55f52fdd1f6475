"""Small documents the stages keep beside a cache's entries and share with every process that uses the cache: the
precompute failure list (`qie.cache.failures`). A backend hands them out as `shared` (`qie.cache.base.CacheStore`),
so a training reads what a precompute wrote wherever the cache is:

- `FolderDocuments`: files in the cache's folder, rewritten under a lock (`cache=ssd`, and a folder backend of
  your own);
- `ProcessDocuments`: in this process only (a cache that does not outlive it; the default of the protocol);
- `qie.cache.remote_shared.SharedDocuments`: in an object store, beside the entries, for every node.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

# What `update` is given: the document's bytes (None: there is none); what it returns replaces them (None: keep).
Change = Callable[[bytes | None], bytes | None]


@runtime_checkable
class Documents(Protocol):
    """Named byte documents, each rewritten whole by one writer at a time (other writers wait)."""

    def read(self, name: str) -> bytes | None:
        """The document's bytes, or None when there is none."""
        ...

    def update(self, name: str, change: Change) -> None:
        """Replace the document by `change(its bytes or None)` (None: leave it), holding it against other
        writers, so that several processes merge their changes instead of losing one another's."""
        ...


class FolderDocuments:
    """Documents as files of `folder` (created on the first write), rewritten atomically under an `fcntl` lock
    (`<name>.lock` beside it)."""

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
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"{name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = change(self.read(name))
            if data is None:
                return
            tmp = self.folder / f".{name}.{secrets.token_hex(4)}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, self.folder / name)


class ProcessDocuments:
    """Documents held by this process only: for a cache that does not outlive it."""

    def __init__(self) -> None:
        self._docs: dict[str, bytes] = {}

    def __repr__(self) -> str:
        return "ProcessDocuments()"

    def read(self, name: str) -> bytes | None:
        return self._docs.get(name)

    def update(self, name: str, change: Change) -> None:
        data = change(self._docs.get(name))
        if data is not None:
            self._docs[name] = data


__all__ = ["Change", "Documents", "FolderDocuments", "ProcessDocuments"]
