"""Claims on a remote cache's entries between processes on different machines: a lease object per claimed
entry (`.claims/<type>/<key>.lease`), created only when none exists (`If-None-Match: *`), holding its expiry.

A lease whose holder died expires after `seconds`; the first process to create the takeover marker of that
expired lease (`<lease>.<nonce>.takeover`, again a create that only one can win) replaces it, so two processes
never hold one entry. Clocks of the machines must agree to well within `seconds` (NTP does).

A lease that could not be released (the store stopped answering) is noted on this node (`note_unreleased`), and
released by the next process of the node that reaches the store (`release_noted`): a run after an outage does not
wait for its predecessor's leases to expire.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path

from qie.cache import files
from qie.cache.remote_store import Store

log = logging.getLogger(__name__)

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
        self.on_failure: Callable[[Lease, Exception], None] | None = None  # the backend notes it (see module)
        self.released = False

    def release(self) -> None:
        """Run `before_release` (the backend writes its index: the claimed entry is listed before others may look
        for it), then delete the lease if it is still this holder's. A failure runs `on_failure` and is raised."""
        if self.released:
            return
        self.released = True
        try:
            if self.before_release is not None:
                self.before_release()
            self.drop()
        except Exception as e:
            if self.on_failure is not None:
                self.on_failure(self, e)
            raise

    def renew(self, seconds: float) -> bool:
        """Extend the lease to `seconds` from now while it is still this holder's; False when it is not."""
        held = read_lease(self.store, self.name)
        if held.get("nonce") != self.nonce:
            return False
        self.store.write(self.name, json.dumps({**held, "expires": time.time() + seconds}).encode())
        return True

    def drop(self) -> None:
        """Delete the lease (when it is still this holder's) and its takeover marker."""
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
    store: Store,
    name: str,
    owner: str,
    seconds: float,
    before_release: Callable | None = None,
    dead: Callable[[dict], bool] | None = None,
) -> Lease | None:
    """The lease object `name` (`lease_name(type, key)`), or None while another holder's lease has not expired.
    `before_release` runs when the holder releases it; `dead(lease)` says whether a lease not yet expired was left
    by a holder known to have died (it is then taken over as an expired one is)."""
    for _ in range(3):
        nonce = secrets.token_hex(8)
        doc = {"owner": owner, "host": socket.gethostname(), "pid": os.getpid(), "nonce": nonce}
        body = json.dumps({**doc, "expires": time.time() + seconds}).encode()
        if store.create(name, body):
            return Lease(store, name, nonce, before_release=before_release)
        held = read_lease(store, name)
        if not held:
            continue  # released meanwhile: try again
        if float(held.get("expires", 0)) > time.time() and not (dead is not None and dead(held)):
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


def holder(store: Store, type: str, key: str) -> tuple[str, str] | None:
    """(who holds the lease on (type, key), until when in words); None when nobody does."""
    held = read_lease(store, lease_name(type, key))
    if not held:
        return None
    until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(held.get("expires", 0))))
    if "host" not in held:
        return str(held.get("owner", "a run whose lease is unreadable")), until
    return f"process {held.get('pid')} on {held['host']} (run {held.get('owner')})", until


def note_unreleased(folder: Path, lease: Lease) -> None:
    """Remember on this node a lease that could not be released, for `release_noted`."""
    doc = {"name": lease.name, "nonce": lease.nonce, "marker": lease.marker}
    files.write_small(f"{folder}/{lease.nonce}.json", json.dumps(doc))


def release_noted(store: Store, folder: Path) -> int:
    """Release the leases this node noted as unreleased (those still held under the noted nonce); returns how many
    notes were settled. A store that still does not answer leaves the rest for the next try."""
    try:
        notes = sorted(folder.glob("*.json"))
    except OSError:
        return 0
    settled = 0
    for note in notes:
        try:
            doc = json.loads(note.read_text())
            lease = Lease(store, str(doc["name"]), str(doc["nonce"]), doc.get("marker"))
        except (OSError, ValueError, KeyError, TypeError):  # gone meanwhile, or unreadable: nothing to release
            lease = None
        if lease is not None:
            lease.drop()  # a store that still does not answer raises: the notes stay for the next try
        try:
            os.unlink(note)
            settled += 1
        except FileNotFoundError:  # settled by another process of the node
            pass
    if settled:
        log.info("released %d claims a run left when the object store stopped answering", settled)
    return settled
