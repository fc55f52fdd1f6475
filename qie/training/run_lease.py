"""One writer per `run.output_url`: a lease object in the store (`.claims/run/writer.lease`), taken as the remote
cache's claims are (`qie.cache.remote_claims`: created only when none exists, holding its holder and expiry), kept
alive by a thread of the writing process while the run lasts, and released at its end.

A run that finds the lease held is refused in one line naming the holder and until when it holds it. A holder
that died without releasing it (killed, its machine lost) holds it until it expires, `LEASE_SECONDS` after its last
renewal; a lease whose process is gone on the holder's own machine, or that an earlier attempt of the same torchrun
job left (`TORCHELASTIC_RUN_ID`: an elastic restart), is taken over at once.
Before each checkpoint upload the writer checks the lease is still its own, so a run whose lease was taken over
while the store did not answer stops instead of writing beside the new holder.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from qie.cache.remote_claims import Lease, holder, lease_name, read_lease, take_lease
from qie.cache.remote_store import Store
from qie.errors import StorageError

log = logging.getLogger(__name__)

# How long a lease lasts without renewal; the writer renews it every quarter of that.
LEASE_SECONDS = 120.0
_LEASE = ("run", "writer")


def elastic_job() -> str | None:
    """The torchrun job this process belongs to (`TORCHELASTIC_RUN_ID`, the same for each of its restarts)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or None


def holder_died(held: dict) -> bool:
    """Whether the lease `held` was left by a process that no longer runs: an earlier attempt of this torchrun job
    (its restarts replace their processes), or a process of this machine that is gone."""
    job = elastic_job()
    if job is not None and str(held.get("owner", "")).partition("@")[2] == job:
        return True
    if held.get("host") != socket.gethostname() or not isinstance(held.get("pid"), int):
        return False
    try:
        os.kill(held["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    return False


class WriterLease:
    """The lease of the run `run_id` on the store `store` (whose url is `url`, for messages).

    Args:
        seconds: how long the lease lasts without renewal.
    """

    def __init__(self, store: Store, url: str, run_id: str, seconds: float = LEASE_SECONDS) -> None:
        self.store, self.url, self.run_id, self.seconds = store, url, run_id, seconds
        self.lease: Lease | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> None:
        """Take the lease and start renewing it.

        Raises:
            StorageError: another run holds it (naming it and until when), or the bucket does not exist.
        """
        name, job = lease_name(*_LEASE), elastic_job()
        owner = self.run_id if job is None else f"{self.run_id}@{job}"
        try:
            self.lease = take_lease(self.store, name, owner, self.seconds, dead=holder_died)
        except FileNotFoundError:  # s3fs's answer to a write into a bucket that does not exist
            raise StorageError(
                f"object store {self.store.where}: the bucket does not exist: create it (aws s3 mb, mc mb, the "
                "store's console) or fix run.output_url"
            ) from None
        if self.lease is None:
            who, until = holder(self.store, *_LEASE) or ("another run", "a moment ago")
            raise StorageError(
                f"run.output_url={self.url} is being written by {who} until {until}: one run writes an output URL "
                "at a time; give this run another run.output_url, or wait for that one (a run that was killed "
                "holds it until then)"
            )
        self._thread = threading.Thread(target=self._renew, name="qie-run-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 4):
            try:
                if not self.lease.renew(self.seconds):
                    log.warning("the lease on %s is no longer this run's", self.url)
                    return
            except Exception as e:  # the store did not answer: try again at the next renewal
                log.warning("could not renew the lease on %s: %s", self.url, e)

    def check(self) -> None:
        """Raise StorageError when the lease is no longer this run's (taken over while it could not be renewed)."""
        if self.lease is None:
            return
        held = read_lease(self.store, self.lease.name)
        if held.get("nonce") != self.lease.nonce:
            who = holder(self.store, *_LEASE)
            raise StorageError(
                f"run.output_url={self.url}: this run's lease was taken over by {who[0] if who else 'nobody'} "
                "while the store did not answer: stopping before writing beside it; the checkpoints are kept in the "
                "run folder"
            )

    def release(self) -> None:
        """Stop renewing and delete the lease (when it is still this run's); a store that does not answer leaves it
        to expire."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.lease is not None:
            try:
                self.lease.release()
            except Exception as e:
                log.warning("could not release the lease on %s (it expires by itself): %s", self.url, e)
            self.lease = None


__all__ = ["LEASE_SECONDS", "WriterLease", "elastic_job", "holder_died"]
