"""An EmbeddingSource that adds each sample's loss mask (`qie.data.masks`) to what another source gives.

It wraps any source (cached, live, lazy), so the step, the loader and collate see one road whatever the mode.
Masks need no model: a mask missing from the cache is made from its image files and written on first use,
and a source without a cache makes them each time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qie.cache.base import CacheBackend
from qie.cache.keys import FileHasher
from qie.data.masks import MASK_TYPE, MaskSettings, make_mask, mask_key, to_grid, to_latent, weights
from qie.data.samples import Sample
from qie.embeddings import CacheReader, EmbeddingSource
from qie.types import SampleEmbeddings


class MaskedSource:
    """`inner`'s embeddings, each with `loss_mask` (1, 1, h, w) loss weights on its latent grid (None for a
    sample without a mask: every pixel weighs 1)."""

    def __init__(
        self,
        inner: EmbeddingSource,
        settings: MaskSettings,
        hasher: FileHasher,
        backend: CacheBackend | None = None,
        outside_weight: float = 0.0,
    ) -> None:
        self.inner, self.settings, self.hasher, self.backend = inner, settings, hasher, backend
        self.outside_weight = outside_weight

    @property
    def encodes(self) -> bool:
        return self.inner.encodes

    @property
    def cache(self) -> CacheReader | None:
        """The inner source's cache (its entries are what readiness checks; masks are made on a miss)."""
        return self.inner.cache

    def get(self, samples: Sequence[Sample]) -> list[SampleEmbeddings]:
        out = self.inner.get(samples)
        for sample, embeds in zip(samples, out):
            grid = self.mask_grid(sample)
            if grid is not None and embeds.pixel_latent is not None:
                h, w = embeds.pixel_latent.shape[-2:]
                embeds.loss_mask = weights(to_latent(grid, h, w), self.outside_weight)
        return out

    def mask_grid(self, sample: Sample) -> torch.Tensor | None:
        """The stored (1, 1, gh, gw) mask of `sample` (made and written on a miss); None when it has none."""
        key = mask_key(sample, self.settings, self.hasher)
        if key is None:
            return None
        entry = self.backend.get(MASK_TYPE, key) if self.backend is not None else None
        if entry is not None:
            return entry["mask"]
        grid = to_grid(make_mask(sample, self.settings))
        if self.backend is not None:
            self.backend.put(MASK_TYPE, key, {"mask": grid})
        return grid

    def with_encoding(self) -> MaskedSource:
        return MaskedSource(self.inner.with_encoding(), self.settings, self.hasher, self.backend, self.outside_weight)

    def release(self) -> None:
        self.inner.release()
