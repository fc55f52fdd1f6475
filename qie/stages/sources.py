"""The embedding source a stage reads samples through, built from its settings (`qie.stages.settings`): the
encoders, the cache-key context of the model, the source `cache.mode` names, and loss masks on top."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qie.cache.base import CacheStore
from qie.components import LoadSettings, load_parts
from qie.config.model import ModelConfig
from qie.data.keys import KeyContext
from qie.data.samples import Sample
from qie.embedding.encode import Encoder, ImageSizes
from qie.embedding.masked import MaskedSource
from qie.embedding.sources import CachedSource, EmbeddingSource, LiveSource, key_context
from qie.errors import DataError
from qie.models import ModelSpec
from qie.stages.settings import LossMasks, SourceSettings, file_hasher


def build_encoder(model: ModelConfig, spec: ModelSpec, devices: Mapping[str, str]) -> Encoder:
    """Encoder with the VAE on `devices["vae"]` and the VL model on `devices["text_encoder"]`; it builds the encoder
    parts of the model's spec (no processor for text-to-image)."""
    return Encoder(load_parts(LoadSettings.of(model), spec, spec.encoder_parts, dict(devices)), spec)


def model_key_context(model: ModelConfig, spec: ModelSpec, sizes: ImageSizes) -> KeyContext:
    """The cache-key context of `model` (fingerprints, template, dtype, quantization) and the image sizes.
    Reads the checkpoint's configs and weight headers; builds and writes nothing."""
    quantize = str(model.text_encoder_quantize)
    return key_context(model.pretrained_model_name_or_path, model.revision, spec, sizes, str(model.dtype), quantize)


def build_source(
    settings: SourceSettings,
    spec: ModelSpec,
    backend: CacheStore | None,
    encoder: Encoder | None = None,
) -> EmbeddingSource:
    """The EmbeddingSource that `settings.mode` names over `backend` (None only for a live source); a backend that
    stores nothing (`cache=none`) is always live. Loss masks are added when `settings.masks` is set.

    A lazy source builds its encoders on its first miss; a cached one never builds them, but can hand out
    a lazy variant (`with_encoding()`) that does.
    """
    source, store = _unmasked_source(settings, spec, encoder, backend)
    return with_masks(source, settings.masks, settings.state_dir, store)


def _unmasked_source(
    settings: SourceSettings, spec: ModelSpec, encoder: Encoder | None, backend: CacheStore | None
) -> tuple[EmbeddingSource, Any]:
    """The source `settings.mode` names, and the backend its masks are stored in (None for a live source)."""

    def make_encoder() -> Encoder:
        return encoder if encoder is not None else build_encoder(settings.model, spec, settings.devices)

    if settings.mode == "live" or (backend is not None and not backend.stores):
        return LiveSource(make_encoder(), settings.sizes), None
    if backend is None:
        raise ValueError(f"a {settings.mode} source reads a cache: give its backend")
    cached = CachedSource(
        backend,
        context=model_key_context(settings.model, spec, settings.sizes),
        hasher=file_hasher(settings.state_dir),
        encoder_factory=make_encoder,
        sizes=settings.sizes,
        precompute_command=settings.precompute_command,
        memo_dir=str(Path(settings.state_dir) / "sample_keys") if settings.state_dir else None,
    )
    return (cached if settings.mode == "cached" else cached.with_encoding()), backend


def with_masks(
    source: EmbeddingSource, masks: LossMasks | None, state_dir: str | None, backend: Any = None
) -> EmbeddingSource:
    """`source`, adding loss masks to its samples when `masks` (`train.mask`) is set (stored in `backend`)."""
    if masks is None:
        return source
    return MaskedSource(source, masks.settings, file_hasher(state_dir), backend, masks.outside_weight)


def check_masks(source: EmbeddingSource, samples: list[Sample], report: bool) -> list[Sample]:
    """The samples whose loss masks (`train.mask`) can train, each mask read at start; the others are skipped
    with a warning, as unreadable images are.

    Raises:
        DataError: no sample left.
    """
    if not isinstance(source, MaskedSource):
        return samples
    kept, problems = source.check_masks(samples)
    for p in problems[:5] if report else []:
        print(f"qie: skipping sample {p.id!r}: {p.path}: {p.reason}")
    if len(problems) > 5 and report:
        print(f"qie: ... and {len(problems) - 5} more samples whose masks cannot train")
    if not kept:
        first = problems[0]
        raise DataError(f"no sample has a loss mask that can train; the first, {first.id!r}: {first.reason}")
    return kept
