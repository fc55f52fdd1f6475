"""Targets an objective computes from the base model (`PrecomputesTargets`: distillation's teacher outputs) in the
run's cache backend, as `teacher_latent` entries: the store the objective reads and (in lazy mode) writes, each entry
under the key of its fields (`entry_key`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from qie.cache.base import CacheStore
from qie.cache.keys import entry_key

# The cache type of every such entry: keyed by the tensors training reads, not by a sample's files (gc keeps them).
ENTRY_TYPE = "teacher_latent"


class BackendTeacherStore:
    """Teacher outputs as `teacher_latent` entries of `backend`; `fills`: missing ones are computed and written."""

    def __init__(self, backend: CacheStore, fills: bool) -> None:
        self.backend, self.fills = backend, fills

    def __repr__(self) -> str:
        return f"BackendTeacherStore({self.backend!r}, fills={self.fills})"

    def read(self, fields: Mapping[str, Any]) -> torch.Tensor | None:
        entry = self.backend.get(ENTRY_TYPE, entry_key(ENTRY_TYPE, dict(fields)))
        return None if entry is None else entry["latent"]

    def holds(self, fields: Mapping[str, Any]) -> bool:
        return self.backend.exists(ENTRY_TYPE, entry_key(ENTRY_TYPE, dict(fields)))

    def write(self, fields: Mapping[str, Any], latents: torch.Tensor) -> None:
        latent = latents.detach().to("cpu", copy=True).contiguous()
        self.backend.put(
            ENTRY_TYPE, entry_key(ENTRY_TYPE, dict(fields)), {"latent": latent}, {"seed": str(fields.get("seed"))}
        )


def teacher_store(backend: CacheStore | None, mode: str) -> BackendTeacherStore | None:
    """The store of `cache.mode`: lazy reads and fills, cached reads; live (or a backend that stores nothing)
    keeps none (teacher outputs are computed every time)."""
    if backend is None or mode == "live" or not backend.stores:
        return None
    return BackendTeacherStore(backend, fills=mode == "lazy")
