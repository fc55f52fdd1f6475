"""Small documents the stages keep beside a remote cache and share between nodes (the precompute failure list),
stored under `.shared/` in the cache's prefix: a training on any node reads what a precompute on another wrote.

A rewrite holds a lease (`.claims/shared/<name>.lease`, taken as an entry's claim is), so writers on several
nodes merge their changes instead of losing one another's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from qie.cache.remote_claims import lease_name, take_lease
from qie.cache.remote_store import Store

FOLDER = ".shared"


class SharedDocuments:
    """The documents under `.shared/` of a remote cache's `store`, rewritten under leases of `owner`."""

    def __init__(self, store: Store, owner: str, lease_seconds: float = 600.0) -> None:
        self.store, self.owner, self.lease_seconds = store, owner, float(lease_seconds)

    def read(self, name: str) -> bytes | None:
        """The document's bytes, or None when there is none."""
        try:
            return self.store.read(f"{FOLDER}/{name}")
        except FileNotFoundError:
            return None

    def update(self, name: str, change: Callable[[bytes | None], bytes | None]) -> None:
        """Replace the document by `change(its bytes or None)` (None: leave it as it is), holding its lease."""
        while (lease := take_lease(self.store, lease_name("shared", name), self.owner, self.lease_seconds)) is None:
            time.sleep(0.2)  # another node is rewriting it: a read and a write
        try:
            data = change(self.read(name))
            if data is not None:
                self.store.write(f"{FOLDER}/{name}", data)
        finally:
            lease.release()


__all__ = ["SharedDocuments"]
