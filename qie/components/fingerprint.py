"""Fingerprints of model parts: what a cache key needs to tell two VAEs or text encoders apart.

A fingerprint hashes the part's config files and every byte of its weight files. Hashing a 16 GB text
encoder takes a while (see docs/benchmarks.md), so each file's digest is remembered in an index
(`$QIE_HOME/weight_hashes.json`) against its path, size, mtime_ns, ctime_ns and inode: the cost is paid once
per file change, and a warm start costs one stat per file. Within a process, a part's fingerprint is remembered
against the signatures (name, size, mtime_ns, ctime_ns, inode) of the files in its folder, so a notebook that
swaps a weight file gets the new fingerprint.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

from qie.cache.keys import FileHasher

INDEX_NAME = "weight_hashes.json"
# (source, subfolder, revision) -> (the folder's file signatures, the fingerprint computed from them)
_REMEMBERED: dict[tuple, tuple[tuple, str]] = {}


def part_folder(source: str, subfolder: str, revision: str | None = None) -> Path:
    """The local folder of one part: `source/subfolder`, or the hub snapshot's copy of its configs.

    For a hub id only the part's JSON files are fetched: the snapshot folder is named by the commit,
    which stands for the weights, so cached training never downloads an encoder to fingerprint it.
    """
    local = Path(source) / subfolder
    if local.is_dir():
        return local
    return _hub_snapshot(source, revision, f"{subfolder}/*.json") / subfolder


def config_file(source: str, relative: str, revision: str | None = None) -> Path:
    """A JSON file of the model (`model_index.json`, `transformer/config.json`), fetched alone from the hub
    like `part_folder` fetches configs; the path may not exist (a folder without it)."""
    if Path(source).is_dir():
        return Path(source) / relative
    return _hub_snapshot(source, revision, relative) / relative


@lru_cache(maxsize=64)  # one hub lookup per part and revision in a process; the files are then stat-checked
def _hub_snapshot(source: str, revision: str | None, pattern: str) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, revision=revision, allow_patterns=[pattern]))


def weight_hasher(index: str | os.PathLike | None = None) -> FileHasher:
    """The FileHasher of weight files (xxh3_128), its index in `$QIE_HOME` unless `index` is given."""
    if index is None:
        from qie.config import qie_home

        index = qie_home() / INDEX_NAME
    return FileHasher(index, algorithm="xxh3_128")


def folder_signature(folder: Path) -> tuple:
    """(name, size, mtime_ns, ctime_ns, inode) of each file in `folder`: changes when any file is rewritten."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    return tuple((p.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino) for p in files if (st := p.stat()))


def part_fingerprint(source: str, subfolder: str, revision: str | None = None) -> str:
    """A hex digest that changes when any byte of the part's config or weight files changes."""
    folder = part_folder(source, subfolder, revision)
    signature = folder_signature(folder)
    remembered = _REMEMBERED.get((source, subfolder, revision))
    if remembered is not None and remembered[0] == signature:
        return remembered[1]
    _REMEMBERED[(source, subfolder, revision)] = (signature, value := _fingerprint(source, subfolder, folder))
    return value


def _fingerprint(source: str, subfolder: str, folder: Path) -> str:
    local = (Path(source) / subfolder).is_dir()
    digest = hashlib.sha256(b"" if local else folder.parent.name.encode())  # a hub snapshot: its commit
    hasher = weight_hasher()
    for path in sorted(folder.iterdir()):
        if not path.is_file():
            continue
        digest.update(path.name.encode() + b"\0")
        if path.suffix == ".json":
            digest.update(path.read_bytes())
        else:
            digest.update(hasher.hash(path).encode())
    try:
        hasher.save()
    except OSError:  # only a speed-up: a read-only QIE_HOME costs a re-hash next time
        pass
    return digest.hexdigest()
