"""A familiar notebook API over qie's cache: `EmbeddingCacheManager` and `check_cache_exists`.

A thin facade: entries are stored by the cache backend precompute uses (the `cache` schema's default on the
folder given, or the backend passed in) exactly as precompute stores them, so what one writes the other reads.
A manager made with a KeyContext (see `qie.api.cache_manager(cfg)`) computes the same keys as precompute and
training; without one, prompt keys cover the prompt and image content only.
The six public type names all work: the mask types are derived from their embeddings (never stored), and a
prompt embedding that shares its image-token prefix with its empty-prompt embedding is joined on load.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from qie.cache.base import CacheBackend
from qie.cache.entries import MASK_OF, read_logical
from qie.cache.keys import FileHasher, entry_key
from qie.config.backend import default_backend
from qie.config.cache import CacheConfig
from qie.data.keys import KeyContext, sample_keys
from qie.data.samples import Sample
from qie.types import FIELD_TYPES, TRAINING_TYPES

# The tensor name each type's single tensor is stored under (control_latent: one per control image).
# The tensor's name in an entry of each type holding one; a sample field's (`<name>_latent`) is "latent" too.
TENSOR_NAMES = {"pixel_latent": "latent", "prompt_embed": "embed", "empty_prompt_embed": "embed"}


class EmbeddingCacheManager:
    """Save, load and inspect cache entries by type and key.

    Args:
        cache_dir: the `cache.dir` of precompute and training.
        context: model fingerprints and image sizes; with it, keys equal those precompute writes.
        backend: where entries are stored (`qie.config.backend.build_backend(typed(cfg.cache))`); None: the `cache`
            schema's default backend on `cache_dir`.
    """

    def __init__(
        self, cache_dir: str | os.PathLike, context: KeyContext | None = None, backend: CacheBackend | None = None
    ) -> None:
        self.cache_dir = Path(cache_dir)
        self.backend = backend if backend is not None else default_backend(str(self.cache_dir))
        self.hasher = FileHasher.in_folder(CacheConfig(dir=str(self.cache_dir)).state_folder())
        self.context = context

    def save_cache(self, cache_type: str, key: str, tensor: torch.Tensor | list[torch.Tensor]) -> int:
        """Store `tensor` (a list of tensors for several control latents); returns bytes written.

        A mask is not stored (0 bytes): it is derived from its embedding's length on load.
        """
        if cache_type in MASK_OF:
            return 0
        if cache_type in ("control_latent", "layer_latent"):
            tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
            return self.backend.put(cache_type, key, {str(i): t for i, t in enumerate(tensors)})
        return self.backend.put(cache_type, key, {TENSOR_NAMES.get(cache_type, "latent"): tensor})

    def load_cache(self, cache_type: str, key: str) -> torch.Tensor | list[torch.Tensor] | None:
        """The stored tensor (a list for control_latent), or None on a miss or an unreadable entry."""
        return read_logical(self.backend, cache_type, key)

    def cache_exists(self, cache_type: str, key: str) -> bool:
        return self.backend.exists(MASK_OF.get(cache_type, cache_type), key)

    def get_cache_stats(self) -> dict[str, int]:
        """Entry count per type, e.g. {'pixel_latent': 100, 'control_latent': 100, ...}; a mask type counts
        the embeddings it is derived from."""
        if not self.cache_dir.is_dir():
            return {t: 0 for t in [*TRAINING_TYPES, *MASK_OF]}
        counts = {t: s["count"] for t, s in self.backend.stats().items()}
        return {t: counts[MASK_OF.get(t, t)] for t in counts}

    def clear_cache(self, cache_type: str | None = None) -> int:
        """Remove all entries, or those of one type; returns how many were removed."""
        if not self.cache_dir.is_dir():
            return 0
        return self.backend.clear([cache_type] if cache_type else None)

    def get_file_hash_for_image(self, image_path: str | os.PathLike) -> str:
        """sha256 of the file's bytes (remembered against path, size, mtime and ctime)."""
        return self.hasher.hash(image_path)

    def get_file_hash_for_prompt(self, image_path: str | os.PathLike | list, prompt: str) -> str:
        """The prompt_embed key of `prompt` seen with the image(s): covers the image content, not only text."""
        paths = image_path if isinstance(image_path, (list, tuple)) else [image_path]
        if self.context is not None:
            sample = Sample(id="api", target=None, controls=tuple(Path(p) for p in paths), prompt=prompt)
            return sample_keys(sample, self.context, self.hasher)["prompt_embed"]
        return entry_key("prompt_embed", {"prompt": prompt, "controls": [self.hasher.hash(p) for p in paths]})

    def keys_for(self, target: str | os.PathLike | None, controls: list, prompt: str) -> dict[str, str]:
        """All keys of a sample, as precompute computes them. Needs a context."""
        if self.context is None:
            raise ValueError("keys_for needs a KeyContext: build the manager with qie.api.cache_manager(cfg)")
        sample = Sample(
            id="api", target=Path(target) if target else None, controls=tuple(Path(c) for c in controls), prompt=prompt
        )
        return sample_keys(sample, self.context, self.hasher)


def check_cache_exists(cache_dir: str | os.PathLike) -> bool:
    """Whether `cache_dir` holds a usable cache: at least one entry of every type training reads (layers and
    rejected results only where a data set has them)."""
    path = Path(cache_dir)
    if not path.is_dir():
        return False
    needed = [t for t in TRAINING_TYPES if t != "layer_latent" and t not in FIELD_TYPES]
    stats = default_backend(str(path)).stats(needed)
    return all(stats[t]["count"] > 0 for t in needed)
