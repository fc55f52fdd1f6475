"""The entries precompute could not write (an unreadable image, non-finite values), kept in the cache folder
(`precompute_failures.json`) so that training skips those samples with the reason instead of stopping.

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

log = logging.getLogger(__name__)

FILE_NAME = "precompute_failures.json"
_FORMAT = "qie-precompute-failures/1"


def read_failures(cache_dir: str | os.PathLike) -> dict[str, dict]:
    """{"type/key": {"sample", "reason"}}; an unreadable file is logged and treated as empty."""
    path = Path(cache_dir) / FILE_NAME
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != _FORMAT or not isinstance(doc.get("entries"), dict):
            raise ValueError("unknown format")
        return doc["entries"]
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, AttributeError) as e:
        log.warning("%s is unreadable (%s); ignoring it", path, e)
        return {}


def update_failures(
    cache_dir: str | os.PathLike, failed: Iterable[tuple[str, str, str, str]], written: Iterable[tuple[str, str]]
) -> None:
    """Add `failed` (type, key, sample id, reason) and drop `written` (type, key), merged under a lock with
    what other processes recorded meanwhile. Writes nothing when there is nothing to change."""
    failed, written = list(failed), list(written)
    folder = Path(cache_dir)
    path = folder / FILE_NAME
    if not failed and not path.exists():
        return
    with open(folder / f"{FILE_NAME}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = read_failures(folder)
        for type, key in written:
            entries.pop(f"{type}/{key}", None)
        for type, key, sample, reason in failed:
            entries[f"{type}/{key}"] = {"sample": sample, "reason": reason}
        tmp = folder / f".{FILE_NAME}.{secrets.token_hex(4)}.tmp"
        tmp.write_text(json.dumps({"format": _FORMAT, "entries": entries}, indent=1))
        os.replace(tmp, path)
