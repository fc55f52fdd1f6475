"""The `remote` backend: entries in an object store (S3, R2, MinIO, GCS, ... through fsspec) with a node-local
read-through copy.

Objects: `<url>/<type>/<key[:2]>/<key>.safetensors` (the bytes and layout of the ssd backend, one PUT per
entry), the index (`.index/`, see `qie.cache.remote_index`), claims (`.claims/`, `qie.cache.remote_claims`), the
documents the stages share between nodes (`.shared/`, the failure list: `qie.cache.remote_shared`) and a marker
that the prefix holds a cache (`.qie-cache.json`). Admin actions list and touch only these names under `url`'s
prefix. An entry is fetched once per node, checked against its checksum, and then read from
`local_dir` (least recently used copies evicted past `local_max_gb`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from qie.cache import folders, remote_admin
from qie.cache.base import (
    CorruptError,
    Entry,
    EntryCounts,
    VerifyReport,
    check_entry,
    check_key,
    check_keys,
    check_meta,
    check_type,
    check_types,
    decode,
    encode,
)
from qie.cache.codec import quick_header
from qie.cache.local_copy import LocalCopy, default_local_dir
from qie.cache.remote_claims import (
    Lease,
    holder,
    lease_name,
    note_unreleased,
    release_noted,
    sweep_leases,
    take_lease,
)
from qie.cache.remote_index import RemoteIndex, flush_at_exit, flush_quietly
from qie.cache.remote_segments import Record
from qie.cache.remote_shared import SharedDocuments
from qie.cache.remote_store import open_store
from qie.errors import CacheDirMissing, ConfigError, StorageError
from qie.types import SCHEMA_VERSION

log = logging.getLogger(__name__)

MARKER = ".qie-cache.json"
_ENTRY_RE = re.compile(r"([a-z_]+)/([0-9A-Za-z_-]{2})/([0-9A-Za-z_-]{2,128})\.safetensors")
_HEAD_BYTES = 64 * 1024


class RemoteBackend:
    """Entries in an object store, read through a node-local copy.

    Args:
        url: where the cache lives, e.g. `s3://BUCKET/PREFIX` (`cache.backend.url`); any fsspec URL works.
        endpoint_url: the S3 endpoint of MinIO, R2 or a local server (`cache.backend.endpoint_url`).
        storage_options: anything else for the fsspec file system (`cache.backend.storage_options`); credentials come
            the standard way (environment, profile) unless given here.
        local_dir: the node-local copy (default `$QIE_HOME/remote/<hash>`); local_max_gb: its size limit.
        verify_reads: check the checksum of local copies on every read too (fetched objects always are).
        lease_seconds: how long a claim holds when its holder dies; retries, backoff, timeout: for each request.
        read_ahead: entry types whose index to start reading now, in the background (a stage's decision: the
            train stage names what its start-up check reads, so the read overlaps its data set scan).
    """

    stores = True
    persists = True
    remote_reads = True

    def __init__(
        self,
        url: str | None = None,
        endpoint_url: str | None = None,
        storage_options: Mapping | None = None,
        local_dir: str | os.PathLike | None = None,
        local_max_gb: float | None = None,
        verify_reads: bool = False,
        lease_seconds: float = 600.0,
        retries: int = 4,
        backoff: float = 0.5,
        timeout: float = 5.0,
        read_ahead: Sequence[str] = (),
    ) -> None:
        if local_max_gb is not None and not 0 < float(local_max_gb) < float("inf"):
            raise ConfigError(
                f"cache.backend.local_max_gb={float(local_max_gb)} is out of range: give the node-local copy's limit "
                "in GiB, above 0 (e.g. 500), or leave it unset for no limit"
            )
        if not url:
            raise ConfigError("cache.backend.url is not set: pass cache=remote cache.backend.url=s3://BUCKET/PREFIX")
        self.url, self.endpoint_url = str(url).rstrip("/"), endpoint_url or None
        if "://" not in self.url:  # fsspec would take it as a folder of this machine: say which was meant
            raise ConfigError(
                f"cache.backend.url={self.url!r} has no scheme: use s3://BUCKET/PREFIX (any fsspec URL), "
                "file:///FOLDER for a folder standing in for a bucket, or cache=ssd cache.dir=FOLDER"
            )
        self.store = open_store("cache", self.url, self.endpoint_url, storage_options, (retries, backoff, timeout))
        local = Path(local_dir) if local_dir else default_local_dir(self.url, self.endpoint_url)
        self.local = LocalCopy(local, int(float(local_max_gb) * 2**30) if local_max_gb else None)
        self.verify_reads, self.lease_seconds = bool(verify_reads), float(lease_seconds)
        host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
        self.owner = f"{host}-{os.getpid()}-{os.urandom(3).hex()}"
        self.index = RemoteIndex(self.store, self.owner)
        self.shared = SharedDocuments(self.store, self.owner, self.lease_seconds)  # the failure list, for every node
        if read_ahead:
            self.index.read_ahead([check_type(t) for t in read_ahead])
        self._held: set[tuple[str, str]] = set()  # entries this backend holds claims on
        self._waited_on: set[str] = set()  # the claim holders a wait was reported for
        self._outage: str | None = None  # why the last release failed, until a claim is taken again
        self._notes = self.local.root / ".unreleased-claims"  # leases left held in an outage (`release_noted`)
        # Entries added since the last segment reach the store when this backend goes, or when the process ends.
        weakref.finalize(self, flush_quietly, self.index).atexit = False
        flush_at_exit(self.index)

    def __repr__(self) -> str:
        return f"RemoteBackend(url={self.store.where!r}, local_dir={str(self.local.root)!r})"

    @staticmethod
    def name(type: str, key: str) -> str:
        """The entry's object name under the root."""
        return f"{type}/{key[:2]}/{key}.safetensors"

    # --- reading and writing ---------------------------------------------------------------------------------

    def get(self, type: str, key: str) -> Entry | None:
        """The entry, from this node's copy or else fetched (once) and checked; None on a miss or an object that
        fails its checksum twice (logged)."""
        check_type(type), check_key(key)
        entry = self._local_entry(type, key, self.index.get(type, key))
        if entry is not None:
            return entry
        for attempt in range(2):
            try:
                data = self.store.read(self.name(type, key))
            except FileNotFoundError:
                return None
            try:
                entry = decode(torch.frombuffer(bytearray(data), dtype=torch.uint8), type, verify=True, key=key)
            except CorruptError as e:
                if attempt:
                    log.warning(
                        "cache object %s is corrupt (%s); treating it as a miss: verify.fix=true removes it",
                        self.store.path(self.name(type, key)),
                        e,
                    )
                    return None
                continue  # a truncated transfer: fetch once more
            self.local.write(type, key, data)
            return entry
        return None

    def _local_entry(self, type: str, key: str, known: Record | None) -> Entry | None:
        """This node's copy, when it is whole and current (its checksum is the index's `known` one, if any); a
        bad copy is removed."""
        buf = self.local.read(type, key)
        if buf is None:
            return None
        try:
            entry = decode(buf, type, verify=self.verify_reads, key=key)
        except CorruptError as e:
            log.warning("local copy of %s/%s is unreadable (%s); fetching it again", type, key, e)
            self.local.drop(type, key)
            return None
        if known is not None and known[1] != entry.checksum:  # rewritten in the store since it was copied
            self.local.drop(type, key)
            return None
        return entry

    def put(self, type: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> int:
        """Store the entry in one request (and keep this node's copy); returns the bytes written."""
        check_type(type), check_key(key), check_entry(tensors)
        data = encode(tensors, type, check_meta(meta), key)
        self.store.write(self.name(type, key), data)
        self.local.write(type, key, data)
        self.index.add(type, key, _record(data, type))
        return len(data)

    def flush(self) -> int:
        """Write the entries added since the last index segment; returns how many."""
        return self.index.flush()

    def exists(self, type: str, key: str) -> bool:
        """Whether this node holds a copy of the entry or the store holds its object (the index is not asked: it
        may list an object deleted since)."""
        check_type(type), check_key(key)
        return self.local.has(type, key) or self.store.size(self.name(type, key)) is not None

    # --- whole-entry checks ----------------------------------------------------------------------------------

    def intact(self, type: str, key: str) -> bool:
        """Whether the entry is stored whole with its base (if any), as the index says: no request per entry (a
        precompute plans a million entries from a few objects). An entry this backend holds a claim on is looked
        up in the store itself, so one another process wrote since the index was read is not encoded again."""
        check_type(type), check_key(key)
        return self._intact(type, key, {}, [], "store" if (type, key) in self._held else "index")

    def intact_all(self, items: Sequence[tuple[str, str]], remember: bool = False) -> list[bool]:
        """Whether each entry is stored whole: the index answers for indexed entries (a few objects read for all),
        the entry's header for the others. With `remember`, entries found whole outside the index are added to it,
        and what this backend wrote since its last index segment is written too."""
        for t in {t for t, _ in items}:
            check_type(t)
        check_keys([k for _, k in items])
        if self.index.all_whole(list(items)):  # the usual start-up: one pass over the index
            if remember:
                self.index.flush()
            return [True] * len(items)
        memo: dict = {}
        found: list[tuple[str, str, Record]] = []
        ok = {item: self._intact(item[0], item[1], memo, found, "fallback") for item in dict.fromkeys(items)}
        if remember:  # the index then lists all of them in the store (this writer's own entries included)
            for t, k, record in found:
                self.index.add(t, k, record)
            self.index.flush()
        return [ok[item] for item in items]

    def _intact(self, type: str, key: str, memo: dict, found: list, mode: str) -> bool:
        record = self._record(type, key, memo, found, mode)
        if record is None:
            return False
        if not record[2]:
            return True
        base_type, _, rest = record[2].partition("/")
        base_key, _, digest = rest.partition("/")
        try:
            base = self._record(check_type(base_type), check_key(base_key), memo, found, mode)
        except ValueError:
            return False
        return base is not None and base[1] == digest and self._intact(base_type, base_key, memo, found, mode)

    def _record(self, type: str, key: str, memo: dict, found: list, mode: str) -> Record | None:
        """The entry's record: from the index ("index"), the index else its header ("fallback", which lists
        what it found by header in `found`), or the object in the store ("store")."""
        if (type, key) not in memo:
            record = self.index.get(type, key) if mode != "store" else None
            if record is None and mode != "index":
                record = self.probe(type, key, local=mode != "store")
                if record is not None:
                    found.append((type, key, record))
            memo[type, key] = record
        return memo[type, key]

    def probe(self, type: str, key: str, local: bool = True) -> Record | None:
        """The entry's record from its header: this node's copy (with `local`), else the object in the store."""
        try:
            if not local:
                raise FileNotFoundError
            with open(self.local.path(type, key), "rb") as f:
                head, size = f.read(_HEAD_BYTES), os.fstat(f.fileno()).st_size
        except OSError:
            try:
                head = self.store.read_range(self.name(type, key), 0, _HEAD_BYTES)
            except FileNotFoundError:
                return None
            size = self.store.size(self.name(type, key)) or 0
        return _record(head, type, size, key)

    # --- claims and access -----------------------------------------------------------------------------------

    def claim(self, type: str, key: str, wait: bool = False) -> Lease | None:
        """A lease on (type, key) against precomputes on any machine; None while another holds it (`wait`:
        poll until it is released or expires). Releasing it first writes the index of what this backend wrote."""
        check_type(type), check_key(key)

        def released() -> None:
            self._held.discard((type, key))
            if self._outage is not None:  # a release just met an outage: noted at once, not retried per claim
                raise StorageError(self._outage)
            self.index.flush()

        waited = False
        while True:
            lease = take_lease(self.store, lease_name(type, key), self.owner, self.lease_seconds, released)
            if lease is not None:
                self._held.add((type, key))
                lease.on_failure = self._unreleased
                if self._outage is not None:  # the store answers again: what was left held is released now
                    self._outage = None
                    release_noted(self.store, self._notes)
            if lease is not None or not wait:
                return lease
            who = None if waited else holder(self.store, type, key)
            waited = True
            if who is not None and who[0] not in self._waited_on:  # each holder named once
                self._waited_on.add(who[0])
                log.warning(
                    "waiting for claims held by %s: the one on %s/%s lasts until %s (it expires then if that run died)",
                    *(who[0], type, key, who[1]),
                )
            time.sleep(min(2.0, self.lease_seconds / 10))

    def _unreleased(self, lease: Lease, error: Exception) -> None:
        self._outage = str(error)
        note_unreleased(self._notes, lease)

    def sweep_temp(self) -> int:
        """Remove expired leases of claimers that died, leases this node's runs could not release in an outage, and
        temp files left in this node's copy; returns how many."""
        removed = release_noted(self.store, self._notes) + sweep_leases(self.store)
        return removed + self.local.sweep_temp(check_types(None))

    def check_access(self, write: bool = False) -> None:
        """Reach the store (one request): a writer writes the cache marker, a reader needs it. Raises
        StorageError naming the endpoint when it is unreachable or the credentials are refused."""
        if write:
            doc = {"format": "qie-remote-cache/1", "schema": str(SCHEMA_VERSION)}
            try:
                self.store.write(MARKER, json.dumps(doc).encode())
            except FileNotFoundError:
                raise StorageError(
                    f"object store {self.store.where}: the bucket does not exist: create it (aws s3 mb, mc mb, the "
                    "store's console) or fix cache.backend.url"
                ) from None
        elif self.store.size(MARKER) is None:
            raise CacheDirMissing(
                f"nothing is cached at {self.store.where} (no {MARKER}): check cache.backend.url, or fill it with "
                "python -m qie.precompute cache=remote cache.backend.url=..."
            )

    # --- admin ---------------------------------------------------------------------------------------------

    def entries(self, type: str, report: VerifyReport | None = None) -> dict[str, int]:
        """{key: size} of the entry objects of `type` (a listing: admin only). In a `file://` store, only entry files
        in real type and shard folders count, as in the ssd backend (a linked folder is skipped, named in `report`):
        admin actions never reach outside the store."""
        if self.store.local:
            return folders.entry_sizes(self.store.root, type, report)
        out = {}
        for name, size in self.store.listing(type).items():
            m = _ENTRY_RE.fullmatch(name)
            if m and m.group(1) == type and m.group(3)[:2] == m.group(2):
                out[m.group(3)] = size
        return out

    def intact_counted(self, counts: Mapping[tuple[str, str], int], remember: bool = False) -> bool:
        """Whether every entry `counts` counts is stored whole: the index answers, type by type (else `intact_all`
        of its items, which looks up the entries the index does not list)."""
        counts = EntryCounts.of(counts)
        for t in counts.by_type():
            check_type(t)
        if not counts.hex_keys:
            check_keys([k for keys, _, _ in counts.by_type().values() for k in keys])
        if self.index.all_whole_counted(counts):
            if remember:
                self.index.flush()
            return True
        return all(self.intact_all(list(counts), remember))

    def keys(self, type: str) -> list[str]:
        """The keys of the stored entries of `type`, sorted."""
        return sorted(self.entries(check_type(type)))

    def stats(self, types: Iterable[str] | None = None) -> dict[str, dict]:
        self.check_access()
        return remote_admin.stats(self, check_types(types))

    def clear(self, types: Iterable[str] | None = None) -> int:
        self.check_access()
        return remote_admin.clear(self, check_types(types))

    def verify(self, types: Iterable[str] | None = None, fix: bool = False) -> VerifyReport:
        """Read every entry object and check it (checksum, base); with `fix`, remove the corrupt ones and bring
        the index in line with what is stored."""
        self.check_access()
        return remote_admin.verify(self, check_types(types), fix)

    def unused(
        self, keep: Mapping[str, set[str]], types: Iterable[str] | None = None, remove: bool = False
    ) -> dict[str, dict]:
        self.check_access()
        return remote_admin.unused(self, keep, check_types(types), remove)


def _record(head: bytes, type: str, size: int | None = None, key: str | None = None) -> Record | None:
    """(size, checksum, base) from an entry's leading bytes; None when they are no whole entry header (of `key`,
    when given)."""
    size = len(head) if size is None else size
    found = quick_header(bytes(head), size, type, key)
    if found is None:
        return None
    digest, meta = found
    base = f"{meta['base']}/{meta.get('base_checksum', '')}" if meta.get("base") else ""
    return size, digest, base
