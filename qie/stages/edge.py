"""What every edge reads first of a composed config, written once: the stages, the Python API, the demo and the
tests make their model spec, embedding source settings, cache backend and embedding source through `Edge`.

The order is the one a user fixes things in: the model (its checkpoint built or checked first, so a checkpoint of
another model is named before anything else), then the data and cache groups and the loss masks of `train.mask`
(where the config has a `train` group), then the backend, then the source over it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qie.cache.base import CacheBackend, CacheStore
from qie.components import prepare_model
from qie.config.backend import build_backend
from qie.config.cache import CacheConfig
from qie.config.data import DataConfig
from qie.config.groups import Groups
from qie.config.model import ModelConfig
from qie.embedding.encode import Encoder
from qie.embedding.sources import EmbeddingSource
from qie.models import ModelSpec
from qie.stages.settings import LossMasks, SourceSettings, loss_masks, source_settings
from qie.stages.sources import build_source


@dataclass(frozen=True)
class Edge:
    """A config's model, data and cache groups as their schemas' dataclasses, with the model's spec and the loss
    masks."""

    model: ModelConfig
    spec: ModelSpec
    data: DataConfig
    cache: CacheConfig
    masks: LossMasks | None

    @classmethod
    def of(cls, groups: Groups, spec: ModelSpec | None = None, masks: bool = True) -> Edge:
        """The edge of a stage's config with `model`, `data` and `cache` groups, read as `groups` (`Checked.groups`).

        Args:
            spec: the model's spec when the caller made it already; else `prepare_model` (the checkpoint built or
                checked).
            masks: read `train.mask`'s loss masks (where the config has a `train` group); False: none.
        """
        model, data = groups.model, groups.data
        train = groups.train if masks else None
        spec = spec or prepare_model(model)
        return cls(model, spec, data, groups.cache, loss_masks(train, data))

    def source_settings(self, mode: str | None = None, command: str | None = None) -> SourceSettings:
        """The embedding source's settings (`mode`: another `cache.mode` than the config's; `command`: the
        precompute command a miss names)."""
        settings = source_settings(self.model, self.data, self.cache, self.spec, self.masks, command)
        return settings.with_mode(mode) if mode else settings

    def backend(self, **overrides: Any) -> CacheBackend:
        """The cache backend the `cache` group names (`overrides`: settings the stage decides)."""
        return build_backend(self.cache, **overrides)

    def source(
        self,
        settings: SourceSettings | None = None,
        backend: CacheStore | None = None,
        encoder: Encoder | None = None,
    ) -> EmbeddingSource:
        """The embedding source of `settings` (the config's by default) over `backend` (built from the `cache`
        node when None and the source reads a cache)."""
        settings = settings or self.source_settings()
        if backend is None and settings.mode != "live":
            backend = self.backend()
        return build_source(settings, self.spec, backend, encoder)
