"""Fingerprints of model parts: what a cache key needs to tell two VAEs or text encoders apart.

Hashing a 16 GB text encoder would take minutes, so a fingerprint hashes the part's config, the names,
sizes and safetensors headers (dtypes, shapes, offsets) of its weight files and a sample of their bytes.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

SAMPLE_BYTES = 1 << 20


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


@lru_cache(maxsize=32)
def part_fingerprint(source: str, subfolder: str, revision: str | None = None) -> str:
    """A hex digest that changes when the part's config or weights change."""
    folder = part_folder(source, subfolder, revision)
    digest = hashlib.sha256(folder.parent.name.encode() if not (Path(source) / subfolder).is_dir() else b"")
    for path in sorted(folder.iterdir()):
        if not path.is_file():
            continue
        digest.update(path.name.encode())
        if path.suffix == ".json":
            digest.update(path.read_bytes())
            continue
        size = path.stat().st_size
        digest.update(str(size).encode())
        with open(path, "rb") as f:
            if path.suffix == ".safetensors":
                header_len = int.from_bytes(f.read(8), "little")
                digest.update(f.read(header_len))
            else:
                digest.update(f.read(SAMPLE_BYTES))
            f.seek(max(0, size - SAMPLE_BYTES), os.SEEK_SET)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()
