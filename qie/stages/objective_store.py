"""What an objective computes ahead of training (distillation's teacher outputs, a plug-in's targets) in the run's
cache backend: the store of one entry type an objective asks its context for (`ObjectiveContext.store`), each entry
one tensor under the key of its fields (`entry_key`). Such types are keyed by the tensors training reads, not by a
sample's files: `gc` keeps them (`action=clear cache.types=[TYPE]` removes them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from qie.cache.base import CacheStore
from qie.cache.keys import entry_key
from qie.training.objectives.context import NoStore
from qie.types import register_store_type

# The name of the one tensor of an entry (distillation's teacher outputs have always been stored under it).
TENSOR = "latent"


class BackendStore:
    """Entries of `entry_type` in `backend`; `fills`: missing ones are computed and written."""

    def __init__(self, backend: CacheStore, entry_type: str, fills: bool) -> None:
        self.backend, self.entry_type, self.fills = backend, entry_type, fills

    def __repr__(self) -> str:
        return f"BackendStore({self.backend!r}, {self.entry_type!r}, fills={self.fills})"

    def _key(self, fields: Mapping[str, Any]) -> str:
        return entry_key(self.entry_type, dict(fields))

    def read(self, fields: Mapping[str, Any]) -> torch.Tensor | None:
        entry = self.backend.get(self.entry_type, self._key(fields))
        return None if entry is None or TENSOR not in entry else entry[TENSOR]

    def holds(self, fields: Mapping[str, Any]) -> bool:
        return self.backend.exists(self.entry_type, self._key(fields))

    def write(self, fields: Mapping[str, Any], value: torch.Tensor) -> None:
        tensor = value.detach().to("cpu", copy=True).contiguous()
        scalars = {k: str(v) for k, v in fields.items() if isinstance(v, int | float | str | bool)}
        self.backend.put(self.entry_type, self._key(fields), {TENSOR: tensor}, scalars)


def objective_store(backend: CacheStore | None, entry_type: str, mode: str) -> BackendStore | NoStore:
    """The store of `entry_type` for `cache.mode`: lazy reads and fills, cached reads, live (or a backend that
    stores nothing) keeps none. `entry_type` becomes a cache type (stats, verify, clear name it).

    Raises:
        ValueError: a name that is not lower-case letters and `_`, or one of the sample entries' types.
    """
    register_store_type(entry_type)
    if backend is None or mode == "live" or not backend.stores:
        return NoStore(entry_type)
    return BackendStore(backend, entry_type, fills=mode == "lazy")
