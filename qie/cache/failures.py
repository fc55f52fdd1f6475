"""The entries precompute could not write (an unreadable image, non-finite values), listed in the cache's shared
documents (`precompute_failures.json`, `qie.cache.base.Documents`) so that training skips those samples with the reason
instead of stopping. Every backend keeps the list where its cache is (`cache=ssd`: its folder; `cache=remote`: its
store, so that a training on any node sees what a precompute on another could not encode).

Keyed by (type, entry key): a fixed image has new bytes, so new keys, and is no longer listed; an entry
written later is removed from the list.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

from qie.cache.base import CacheStore

log = logging.getLogger(__name__)

FILE_NAME = "precompute_failures.json"
_FORMAT = "qie-precompute-failures/1"


def read_failures(backend: CacheStore) -> dict[str, dict]:
    """{"type/key": {"sample", "reason"}} from `backend.shared`; an unreadable list is logged and treated as empty."""
    where = f"{FILE_NAME} of {backend!r}"
    try:
        return _entries(backend.shared.read(FILE_NAME), where)
    except OSError as e:
        log.warning("%s is unreadable (%s); ignoring it", where, e)
        return {}


def _entries(data: bytes | None, where: str) -> dict[str, dict]:
    try:
        doc = json.loads(data) if data is not None else {"format": _FORMAT, "entries": {}}
        if doc.get("format") != _FORMAT or not isinstance(doc.get("entries"), dict):
            raise ValueError("unknown format")
        return doc["entries"]
    except (ValueError, AttributeError) as e:
        log.warning("%s is unreadable (%s); ignoring it", where, e)
        return {}


def _merged(entries: dict, failed: list, written: list) -> bytes:
    """The list `entries` with `failed` (type, key, sample id, reason) added and `written` (type, key) dropped."""
    for type, key in written:
        entries.pop(f"{type}/{key}", None)
    for type, key, sample, reason in failed:
        entries[f"{type}/{key}"] = {"sample": sample, "reason": reason}
    return json.dumps({"format": _FORMAT, "entries": entries}, indent=1).encode()


def update_failures(
    backend: CacheStore, failed: Iterable[tuple[str, str, str, str]], written: Iterable[tuple[str, str]]
) -> None:
    """Add `failed` (type, key, sample id, reason) and drop `written` (type, key) in `backend.shared`, merged with
    what other processes recorded meanwhile. Writes nothing when there is nothing to change."""
    failed, written = list(failed), list(written)
    if not failed and backend.shared.read(FILE_NAME) is None:
        return
    where = f"{FILE_NAME} of {backend!r}"
    backend.shared.update(FILE_NAME, lambda data: _merged(_entries(data, where), failed, written))
