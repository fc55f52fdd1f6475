"""The entries precompute could not write (an unreadable image, non-finite values), kept in the cache folder
(`precompute_failures.json`) so that training skips those samples with the reason instead of stopping. A backend
whose cache many nodes share (the remote one) keeps the list in its store, beside the entries, so that a training
on any node sees what a precompute on another could not encode.

Keyed by (type, entry key): a fixed image has new bytes, so new keys, and is no longer listed; an entry
written later is removed from the list.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE_NAME = "precompute_failures.json"
_FORMAT = "qie-precompute-failures/1"


def read_failures(cache_dir: str | os.PathLike | None, backend: Any = None) -> dict[str, dict]:
    """{"type/key": {"sample", "reason"}}; an unreadable list is logged and treated as empty.

    Args:
        cache_dir: the cache folder (`cache.dir`) holding the list; None: no list.
        backend: a backend that shares documents between nodes (the remote one's `shared`) keeps the list there.
    """
    shared = getattr(backend, "shared", None)
    if shared is not None:
        return _entries(shared.read(FILE_NAME), f"{FILE_NAME} of {backend!r}")
    if cache_dir is None:
        return {}
    path = Path(cache_dir) / FILE_NAME
    try:
        return _entries(path.read_bytes(), str(path))
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("%s is unreadable (%s); ignoring it", path, e)
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
    cache_dir: str | os.PathLike,
    failed: Iterable[tuple[str, str, str, str]],
    written: Iterable[tuple[str, str]],
    backend: Any = None,
) -> None:
    """Add `failed` (type, key, sample id, reason) and drop `written` (type, key), merged under a lock with
    what other processes recorded meanwhile (in `backend`'s shared documents when it has them, see
    `read_failures`). Writes nothing when there is nothing to change."""
    failed, written = list(failed), list(written)
    shared = getattr(backend, "shared", None)
    if shared is not None:
        if failed or shared.read(FILE_NAME) is not None:
            where = f"{FILE_NAME} of {backend!r}"
            shared.update(FILE_NAME, lambda data: _merged(_entries(data, where), failed, written))
        return
    folder = Path(cache_dir)
    path = folder / FILE_NAME
    if not failed and not path.exists():
        return
    with open(folder / f"{FILE_NAME}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = _merged(read_failures(folder), failed, written)
        tmp = folder / f".{FILE_NAME}.{secrets.token_hex(4)}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, path)
