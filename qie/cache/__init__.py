"""Embedding cache: entries (dicts of named tensors) stored under (type, key) by a pluggable backend.

Backends: `ssd` (files), `memory` (in-process), `none` (always a miss), `remote` (an object store
through fsspec, with a node-local copy). A new backend is one module with
a class following `CacheBackend` and one yaml file naming it in `_target_` (built by `qie.config.backend`,
with the constructor arguments of its own the yaml gives). `qie.cache.entries` maps a
sample's six public types onto what is stored (the shared prompt prefix, masks derived).

This package imports torch, safetensors and xxhash only: no model library, no Hydra, and nothing of
qie but its leaf modules (`qie.types`, `qie.errors`). The notebook facade over it is `qie.embedding.manager`.
"""

from __future__ import annotations

from qie.cache.base import (
    SCHEMA_VERSION,
    CacheBackend,
    Claim,
    CorruptEntry,
    Entry,
    VerifyReport,
    check_key,
    check_type,
    check_types,
)
from qie.types import CACHE_TYPES

__all__ = [
    "CACHE_TYPES",
    "SCHEMA_VERSION",
    "CacheBackend",
    "Claim",
    "CorruptEntry",
    "Entry",
    "VerifyReport",
    "check_key",
    "check_type",
    "check_types",
]
