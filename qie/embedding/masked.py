"""An EmbeddingSource that adds each sample's loss mask (`qie.data.masks`) to what another source gives.

It wraps any source (cached, live, lazy), so the step, the loader and collate see one road whatever the mode.
Masks need no model: a mask missing from the cache is made from its image files and written on first use,
and a source without a cache makes them each time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qie.cache.base import CacheStore
from qie.cache.keys import FileHasher
from qie.data.masks import MASK_TYPE, MaskSettings, make_mask, mask_key, to_grid, to_latent, weights
from qie.data.samples import DataProblem, Sample
from qie.embedding.sources import CacheReader, EmbeddingSource
from qie.errors import DataError
from qie.types import SampleEmbeddings


class MaskedSource:
    """`inner`'s embeddings, each with `loss_mask` (1, 1, h, w) loss weights on its latent grid (None for a
    sample without a mask: every pixel weighs 1)."""

    def __init__(
        self,
        inner: EmbeddingSource,
        settings: MaskSettings,
        hasher: FileHasher,
        backend: CacheStore | None = None,
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

    def check_masks(self, samples: Sequence[Sample]) -> tuple[list[Sample], list[DataProblem]]:
        """Every sample's mask read (or made) now, before training: a mask that cannot be read or has another
        shape than its target, and one that trains nothing (black all over while black weighs 0), are problems
        of their samples, which are left out; the others are kept."""
        kept, problems = [], []
        for sample in samples:
            try:
                grid = self.mask_grid(sample)
            except DataError as e:
                problems.append(DataProblem(sample.id, str(getattr(e, "path", None) or sample.mask), str(e)))
                continue
            if grid is not None and self.outside_weight == 0 and not bool((grid > 0).any()):
                path = sample.mask if self.settings.source == "file" else sample.target
                why = (
                    "its loss mask is black all over"
                    if self.settings.source == "file"
                    else "its target equals its control image (within train.mask.threshold): its edit mask is empty"
                )
                problems.append(
                    DataProblem(
                        sample.id,
                        str(path),
                        f"{why}, so with train.mask.outside_weight=0 it "
                        "would train nothing: paint white what should train",
                    )
                )
                continue
            kept.append(sample)
        return kept, problems

    def with_encoding(self) -> MaskedSource:
        return MaskedSource(self.inner.with_encoding(), self.settings, self.hasher, self.backend, self.outside_weight)

    def release(self) -> None:
        self.inner.release()
