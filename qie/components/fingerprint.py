"""Fingerprints of model parts: what a cache key needs to tell two VAEs or text encoders apart.

A fingerprint hashes the part's config files and every byte of its weight files. Hashing a 16 GB text
encoder takes a while (see docs/benchmarks.md), so each file's digest is remembered in an index
(`$QIE_HOME/weight_hashes.json`) against its path, size, mtime_ns, ctime_ns and inode: the cost is paid once
per file change, and a warm start costs one stat per file.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

from qie.cache.keys import FileHasher

INDEX_NAME = "weight_hashes.json"


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


def _hub_snapshot(source: str, revision: str | None, pattern: str) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, revision=revision, allow_patterns=[pattern]))


def weight_hasher(index: str | os.PathLike | None = None) -> FileHasher:
    """The FileHasher of weight files (xxh3_128), its index in `$QIE_HOME` unless `index` is given."""
    if index is None:
        from qie.config import qie_home

        index = qie_home() / INDEX_NAME
    return FileHasher(index, algorithm="xxh3_128")


@lru_cache(maxsize=32)
def part_fingerprint(source: str, subfolder: str, revision: str | None = None) -> str:
    """A hex digest that changes when any byte of the part's config or weight files changes."""
    folder = part_folder(source, subfolder, revision)
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
