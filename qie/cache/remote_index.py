"""The index of a remote cache: per entry type, which entries are stored whole, with their size, checksum and
base, in a few objects (`.index/<type>/<segment>.safetensors`: columns of keys, sizes, checksums and the distinct
bases; segments of the JSON form written before, `<segment>.json`, are read and merged away), so a start-up check
reads those, never a listing of millions of entries.

Objects cannot be appended to, and several writers (precompute processes on several nodes) add entries at
once: each writer keeps segments of its own (`<writer>-<n>.json`), never rewriting another's. A flush rewrites
the writer's open segment with what it holds plus the new entries (one PUT per type), and a segment that reached
`SEGMENT_ENTRIES` is closed; precompute flushes before it releases a claim, so an entry is indexed before another
process may look for it. A reader that finds many segments merges them into one and deletes the ones it merged
(only those it read whole). Removing entries (verify.fix, gc, clear) writes the merged index without them.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
import weakref
from operator import itemgetter

from qie.cache.base import EntryCounts
from qie.cache.remote_segments import SUFFIXES, Record, decode, encode
from qie.cache.remote_store import Store

log = logging.getLogger(__name__)

FOLDER = ".index"
# More segments than this in one type are merged by the next reader.
MERGE_ABOVE = 16
# A writer's segment holding this many entries is closed; its next flush starts another.
SEGMENT_ENTRIES = 4096


class RemoteIndex:
    """What the store's index says, loaded per type on first use, and what this writer adds to it.

    Args:
        store: the store.
        writer: this writer's name in segment names (unique per process).
        flush_every, flush_seconds: added entries are written once this many are pending, or when one is added
            this long after the last flush (and by `flush`).
    """

    def __init__(self, store: Store, writer: str, flush_every: int = 1024, flush_seconds: float = 30.0) -> None:
        self.store, self.writer = store, writer
        self.flush_every, self.flush_seconds = int(flush_every), float(flush_seconds)
        self._records: dict[str, dict[str, Record]] = {}
        self._pending: dict[str, dict[str, Record]] = {}
        self._open: dict[str, tuple[str, dict[str, Record]]] = {}  # per type: this writer's open segment
        self._seq = 0
        self._last_flush = time.monotonic()
        self._lock = threading.RLock()
        self._ahead: tuple[list[str], threading.Event, dict] | None = None  # a read started by `read_ahead`

    def records(self, type: str) -> dict[str, Record]:
        """{key: record} of `type` (read from the store on first use)."""
        with self._lock:
            if type not in self._records:
                self._records[type] = self._load(type)
            return self._records[type]

    def preload(self, types: list[str]) -> None:
        """Read the index of each of `types` not read yet: one listing of the index folder for all of them, and
        their segments read at once (a start-up's round trips: two, not two per type); what `read_ahead` read of
        them is taken instead."""
        with self._lock:
            todo = [t for t in dict.fromkeys(types) if t not in self._records]
            found = self._taken_ahead(todo) if todo else None
            if found is None and len(todo) < 2:  # one type: its own listing and one read (`_load`), as few
                return
            listed, fetched = found or self._fetch(todo)
            for t in todo:
                self._records[t] = self._load(t, listed[t], fetched)

    def read_ahead(self, types: list[str]) -> None:
        """Start reading the index of `types` on a thread of its own (a start-up names what its check will read, so
        the read overlaps its data set scan); the next `preload` of them waits for it and takes what it read. A
        read that failed is left to that `preload`, which reads again and reports."""
        todo = list(dict.fromkeys(types))
        done, box = threading.Event(), {}

        def read() -> None:
            try:
                listed, fetched = self._fetch(todo)
                for type, names in listed.items():  # decoded here too: a segment that fails stays bytes
                    for name in names:
                        with contextlib.suppress(Exception):
                            fetched[name] = decode(fetched[name], type) if fetched.get(name) is not None else None
                box["found"] = (listed, fetched)
            except Exception as e:  # the check's own read meets it again and names it
                log.debug("reading the index ahead failed (%s)", e)
            finally:
                done.set()

        self._ahead = (todo, done, box)
        threading.Thread(target=read, name="qie-index-ahead", daemon=True).start()

    def _taken_ahead(self, todo: list[str]) -> tuple[dict[str, list[str]], dict] | None:
        """What `read_ahead` read, when it covers `todo` and succeeded (waited for while it runs); used once."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or not set(todo) <= set(ahead[0]):
            return None
        ahead[1].wait()
        return ahead[2].get("found")

    def _fetch(self, types: list[str]) -> tuple[dict[str, list[str]], dict[str, bytes | None]]:
        """(each type's segment names, their bytes): one listing of the index folder, the segments read at once."""
        listed: dict[str, list[str]] = {t: [] for t in types}
        for name in sorted(self.store.listing(FOLDER)):
            parts = name.split("/")
            if len(parts) == 3 and parts[1] in listed and name.endswith(SUFFIXES):
                listed[parts[1]].append(name)
        return listed, self.store.read_many([n for names in listed.values() for n in names])

    def get(self, type: str, key: str) -> Record | None:
        return self.records(type).get(key)

    def all_whole(self, items: list[tuple[str, str]]) -> bool:
        """Whether the index lists every (type, key) of `items`, each with its base (if any) listed under the
        checksum it records: the start-up check of a whole set in one pass (no base of a base is followed: such
        an entry answers False, and the caller checks entry by entry)."""
        types = list(dict.fromkeys(t for t, _ in items))
        self.preload(types)
        records = {t: self.records(t) for t in types}
        get = {t: r.get for t, r in records.items()}
        for type, key in items:
            record = get[type](key)
            if record is None:
                return False
            if record[2]:
                base_type, base_key, digest = record[2].split("/", 2)
                base = records[base_type].get(base_key) if base_type in records else self.get(base_type, base_key)
                if base is None or base[1] != digest or base[2]:
                    return False
        return True

    def all_whole_counted(self, counts: EntryCounts) -> bool:
        """`all_whole` of the entries `counts` holds, type by type: each type's keys looked up at once, each distinct
        base checked once (a million prompt entries name a hundred thousand bases)."""
        by_type = counts.by_type()
        self.preload(list(by_type))
        records = {t: self.records(t) for t in by_type}
        bases: set[str] = set()
        for type, (keys, _, _) in by_type.items():
            found = list(map(records[type].get, keys))
            if None in found:
                return False
            bases.update(map(itemgetter(2), found))
        bases.discard("")
        for base in bases:
            base_type, base_key, digest = base.split("/", 2)
            record = records[base_type].get(base_key) if base_type in records else self.get(base_type, base_key)
            if record is None or record[1] != digest or record[2]:
                return False
        return True

    def add(self, type: str, key: str, record: Record) -> None:
        with self._lock:
            self.records(type)[key] = record
            self._pending.setdefault(type, {})[key] = record
            count = sum(map(len, self._pending.values()))
            if count >= self.flush_every or time.monotonic() - self._last_flush > self.flush_seconds:
                self.flush()

    def flush(self) -> int:
        """Write the pending entries into this writer's open segment of each type; returns how many."""
        with self._lock:
            self._last_flush = time.monotonic()
            written = 0
            for type in list(self._pending):
                if type not in self._open:
                    self._seq += 1
                    self._open[type] = (f"{self.writer}-{self._seq}", {})
                stem, held = self._open[type]
                segment = {**held, **self._pending[type]}
                self._write(type, stem, segment)  # the entries stay pending if it fails
                written += len(self._pending.pop(type))
                self._open[type] = (stem, segment)
                if len(segment) >= SEGMENT_ENTRIES:
                    del self._open[type]
            return written

    def forget(self, type: str, keys: set[str]) -> None:
        """Remove `keys` from the index of `type`: the merged index without them replaces its segments."""
        with self._lock:
            self.flush()
            segments = self._segments(type)
            merged = self._read_all(type, segments)
            for key in keys:
                merged.pop(key, None)
            self._records[type] = merged
            self._open.pop(type, None)  # merged and deleted below: the next flush starts another
            self._replace(type, merged, segments)

    def clear(self, type: str) -> None:
        """Drop the whole index of `type` (its entries are gone)."""
        with self._lock:
            self._pending.pop(type, None)
            self._open.pop(type, None)
            self._records[type] = {}
            for name in self._segments(type):
                self.store.remove(name)

    def reload(self) -> None:
        """Forget what was read: the next use reads the store again (after other writers added entries)."""
        with self._lock:
            self.flush()
            self._records.clear()
            self._ahead = None

    # --- segments ------------------------------------------------------------------------------------------

    def _segments(self, type: str) -> list[str]:
        return sorted(n for n in self.store.listing(f"{FOLDER}/{type}") if n.endswith(SUFFIXES))

    def _load(
        self, type: str, segments: list[str] | None = None, fetched: dict[str, bytes | dict | None] | None = None
    ) -> dict[str, Record]:
        """The index of `type`: its `segments` (listed when not given) read (or taken from `fetched`), and merged
        into one when there are many."""
        segments = self._segments(type) if segments is None else segments
        merged = self._read_all(type, segments, fetched)
        if len(segments) > MERGE_ABOVE:
            self._replace(type, merged, segments)
        return merged

    def _read_all(
        self, type: str, segments: list[str], fetched: dict[str, bytes | dict | None] | None = None
    ) -> dict[str, Record]:
        """The union of the segments' entries (their bytes, or entries decoded ahead, from `fetched`, else all read at
        once); a segment that vanished (merged meanwhile) or is unreadable is dropped from `segments`, so that only
        segments read whole are ever replaced."""
        merged: dict[str, Record] = {}
        fetched = self.store.read_many(segments) if fetched is None else fetched
        for name in list(segments):
            try:
                data = fetched.get(name)
                if data is None:
                    raise FileNotFoundError(name)
                found = data if isinstance(data, dict) else decode(data, type)
                if len(segments) == 1 and not merged:  # the only segment: its entries as decoded
                    return found
                merged.update(found)
            except FileNotFoundError:
                segments.remove(name)
            except Exception as e:  # safetensors raises its own error types for a damaged segment
                log.warning("index segment %s is unreadable (%s); ignoring it", name, e)
                segments.remove(name)
        return merged

    def _replace(self, type: str, merged: dict[str, Record], segments: list[str]) -> None:
        """Write `merged` as one segment, then delete `segments` (which it holds)."""
        self._write(type, f"{self.writer}-m{secrets.token_hex(4)}", merged)
        for name in segments:
            self.store.remove(name)

    def _write(self, type: str, stem: str, entries: dict[str, Record]) -> None:
        self.store.write(f"{FOLDER}/{type}/{stem}{SUFFIXES[0]}", encode(entries, type))


# --- flushing when a backend goes --------------------------------------------------------------------------


def flush_quietly(index: RemoteIndex) -> None:
    """Write the pending index entries when a backend goes. The collector may run this on the file system's own
    event-loop thread, which cannot wait for its own requests: there the flush runs on a thread of its own."""
    import asyncio

    def flush() -> None:
        try:
            index.flush()
        except Exception as e:  # the next start-up check finds the entries by their headers and indexes them
            log.warning("the cache index could not be written (%s); the next check adds the entries", e)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        flush()
    else:
        threading.Thread(target=flush, name="qie-index-flush").start()


_LIVE: weakref.WeakSet = weakref.WeakSet()
_REGISTERED: list[bool] = []


def flush_at_exit(index: RemoteIndex) -> None:
    """Flush `index` when the interpreter shuts down, before the thread pools the HTTP client resolves names with
    are shut down (`atexit` runs after that, when no request can be made any more)."""
    if not _REGISTERED:
        _REGISTERED.append(True)
        register = getattr(threading, "_register_atexit", None)
        if register is None:
            import atexit

            atexit.register(flush_live)
        else:
            register(flush_live)
    _LIVE.add(index)


def flush_live() -> None:
    """Write the pending entries of every live index now (what `flush_at_exit` does at shutdown)."""
    for index in list(_LIVE):
        flush_quietly(index)
