"""Claims on a remote cache's entries between processes on different machines: a lease object per claimed
entry (`.claims/<type>/<key>.lease`), created only when none exists (`If-None-Match: *`), holding its expiry.

A lease whose holder died expires after `seconds`; the first process to create the takeover marker of that
expired lease (`<lease>.<nonce>.takeover`, again a create that only one can win) replaces it, so two processes
never hold one entry. Clocks of the machines must agree to well within `seconds` (NTP does).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable

from qie.cache.remote_store import Store

FOLDER = ".claims"


def lease_name(type: str, key: str) -> str:
    return f"{FOLDER}/{type}/{key}.lease"


class Lease:
    """A claim held through a lease object; `release` deletes it (when it is still this holder's)."""

    def __init__(
        self, store: Store, name: str, nonce: str, marker: str | None = None, before_release: Callable | None = None
    ) -> None:
        self.store, self.name, self.nonce, self.marker = store, name, nonce, marker
        self.before_release = before_release
        self.released = False

    def release(self) -> None:
        """Run `before_release` (the backend writes its index: the claimed entry is listed before others may look
        for it), then delete the lease if it is still this holder's."""
        if self.released:
            return
        self.released = True
        if self.before_release is not None:
            self.before_release()
        if read_lease(self.store, self.name).get("nonce") == self.nonce:
            self.store.remove(self.name)
        if self.marker is not None:
            self.store.remove(self.marker)


def read_lease(store: Store, name: str) -> dict:
    """The lease's content; {} when there is none; an unreadable lease reads as expired long ago."""
    try:
        doc = json.loads(store.read(name))
        return doc if isinstance(doc, dict) else {"expires": 0}
    except FileNotFoundError:
        return {}
    except ValueError:
        return {"expires": 0}


def take_lease(
    store: Store, type: str, key: str, owner: str, seconds: float, before_release: Callable | None = None
) -> Lease | None:
    """The lease on (type, key), or None while another holder's lease has not expired. `before_release` runs
    when the holder releases it."""
    name = lease_name(type, key)
    for _ in range(3):
        nonce = secrets.token_hex(8)
        body = json.dumps({"owner": owner, "nonce": nonce, "expires": time.time() + seconds}).encode()
        if store.create(name, body):
            return Lease(store, name, nonce, before_release=before_release)
        held = read_lease(store, name)
        if not held:
            continue  # released meanwhile: try again
        if float(held.get("expires", 0)) > time.time():
            return None
        marker = f"{name}.{held.get('nonce', 'unreadable')}.takeover"
        if not store.create(marker, body):
            return None  # another process is taking this expired lease over
        store.write(name, body)
        return Lease(store, name, nonce, marker, before_release)
    return None


def sweep_leases(store: Store) -> int:
    """Remove expired leases and takeover markers (of holders that died); returns how many."""
    removed, now = 0, time.time()
    for name in store.listing(FOLDER):
        if not name.endswith((".lease", ".takeover")):
            continue
        held = read_lease(store, name)
        if held and float(held.get("expires", 0)) < now and store.remove(name):
            removed += 1
    return removed
