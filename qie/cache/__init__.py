"""Embedding cache: entries (dicts of named tensors) stored under (type, key) by a pluggable backend.

Backends: `ssd` (files), `memory` (in-process), `none` (always a miss), `remote` (an object store through
fsspec, with a node-local copy). A new backend is one module with
a class following `CacheBackend` and one yaml file naming it in `_target_`. `qie.cache.entries` maps a
sample's six public types onto what is stored (the shared prompt prefix, masks derived).

This package imports torch, safetensors and xxhash only: no model library, no Hydra, and nothing of
qie but its leaf modules (`qie.types`, `qie.errors`). The notebook facade over it is `qie.embedding_cache`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping

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
from qie.errors import ConfigError
from qie.types import CACHE_TYPES


def build_backend(
    target: str, dir: str | None, verify_reads: bool = False, settings: Mapping | None = None
) -> CacheBackend:
    """Construct the backend class named by the dotted path `target` (`cache._target_`) with `dir`.

    Args:
        target: e.g. "qie.cache.ssd.SsdBackend".
        dir: `cache.dir`; the ssd backend needs it, the others ignore it.
        verify_reads: `cache.verify_reads`: check each entry's checksum when it is read.
        settings: the `cache` config; those of its keys the class's constructor names (the remote backend's
            `url`, `endpoint_url`, ...) are passed to it too.

    Raises:
        ConfigError: when `target` names no importable backend class, or the backend rejects `dir`.
    """
    module_name, _, class_name = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name) if module_name else None
    except (ImportError, ValueError) as e:
        raise ConfigError(f"cache._target_={target!r} cannot be imported: {e}") from None
    except AttributeError:
        cls = None
    if not isinstance(cls, type):
        raise ConfigError(
            f"cache._target_={target!r} is not a class: expected a dotted path such as 'qie.cache.ssd.SsdBackend'"
        )
    kwargs = _own_settings(cls, settings)
    try:
        backend = cls(dir=dir, verify_reads=True, **kwargs) if verify_reads else cls(dir=dir, **kwargs)
    except TypeError as e:
        raise ConfigError(f"cache._target_={target!r} cannot be built with dir={dir!r}: {e}") from None
    if not isinstance(backend, CacheBackend):
        raise ConfigError(f"cache._target_={target!r} does not implement the CacheBackend protocol")
    return backend


def _own_settings(cls: type, settings: Mapping | None) -> dict:
    """The entries of `settings` that `cls`'s constructor takes by name (besides dir and verify_reads)."""
    if not settings:
        return {}
    named = inspect.signature(cls).parameters
    return {k: settings[k] for k in settings if k in named and k not in ("dir", "verify_reads")}


__all__ = [
    "CACHE_TYPES",
    "SCHEMA_VERSION",
    "CacheBackend",
    "Claim",
    "CorruptEntry",
    "Entry",
    "VerifyReport",
    "build_backend",
    "check_key",
    "check_type",
    "check_types",
]
