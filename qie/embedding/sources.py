"""EmbeddingSource: the one road from samples to the tensors a training step (or a sampler) needs.

`cached` reads the cache only (no encoder is ever built), `live` encodes every time, `lazy` reads the
cache and encodes + writes what is missing (building its encoder on the first miss). The training step
sees `SampleEmbeddings` and never knows which source produced them; stages and readiness ask a source what
they need to know (`encodes`, `cache`, `with_encoding`) instead of asking what class it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import cache
from typing import Protocol

import numpy as np
import torch

from qie.cache.base import CacheStore
from qie.cache.entries import read_entries, write_entries
from qie.cache.keys import FileHasher
from qie.data.key_memo import KeyMemo
from qie.data.keys import KeyContext, sample_keys
from qie.data.samples import Sample
from qie.embedding.encode import Encoder, ImageSizes, prepare_sample
from qie.errors import CacheMissError
from qie.models import ModelSpec
from qie.types import FIELD_TYPES, TRAINING_TYPES, SampleEmbeddings, field_of_type

log = logging.getLogger(__name__)
EncoderFactory = Callable[[], Encoder]
DEFAULT_PRECOMPUTE_COMMAND = "python -m qie.precompute model=... data.path=... cache.dir=..."


def sample_types(sample: Sample) -> tuple[str, ...]:
    """The entry types `sample` has: no pixel_latent without a target, no control_latent without controls, no
    layer_latent without layers, no `<field>_latent` without the field's image (`qie.data.fields`: rejected_latent
    without a rejected result). One tuple object per kind of sample (a million samples share a few)."""
    fields = tuple(name for name, _ in sample.field_images) if sample.field_images else ()
    return types_of_kind(sample.target is not None, bool(sample.controls), bool(sample.layers), fields)


@cache
def types_of_kind(target: bool, controls: bool, layers: bool, fields: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The entry types of a sample with (or without) a target, controls, layers, and the images of `fields`
    (their names): TRAINING_TYPES' order, then the other fields' types."""
    field_types = {f"{name}_latent" for name in fields}
    has = {"pixel_latent": target, "control_latent": controls, "layer_latent": layers}
    base = tuple(t for t in TRAINING_TYPES if has.get(t, t not in FIELD_TYPES or t in field_types))
    return base + tuple(sorted(field_types - set(base)))


def from_entries(sample_id: str, entries: dict, cached: bool) -> SampleEmbeddings:
    """SampleEmbeddings from cache entries (type name -> dict of named tensors; a prompt embedding may be
    a tuple of pieces, as `read_entries` gives it)."""
    controls = entries.get("control_latent", {})
    pixel = entries.get("pixel_latent")
    latent = pixel["latent"] if pixel is not None else None
    if latent is not None and "layer_latent" in entries:  # a layered target: its frames, the layers after it
        layers = entries["layer_latent"]
        latent = torch.cat([latent, *(layers[str(k)] for k in range(len(layers)))], dim=1)
    embeds = SampleEmbeddings(
        id=sample_id,
        pixel_latent=latent,
        control_latents=tuple(controls[str(k)] for k in range(len(controls))),
        prompt_embed=entries["prompt_embed"]["embed"],
        empty_prompt_embed=entries["empty_prompt_embed"]["embed"],
        cached=cached,
        prompt_image_mask=entries["prompt_embed"].get("image_mask"),
        empty_prompt_image_mask=entries["empty_prompt_embed"].get("image_mask"),
    )
    for type, tensors in entries.items():
        if (name := field_of_type(type)) is not None:
            embeds.fields[name] = tensors["latent"]
    return embeds


class CacheReader(Protocol):
    """The cache a source reads: its backend and each sample's entry keys (what readiness checks)."""

    backend: CacheStore

    def keys(self, sample: Sample) -> dict[str, str]:
        """The entry key of each type `sample` has."""
        ...

    def keys_all(self, samples: Sequence[Sample]) -> list[dict[str, str] | OSError]:
        """`keys` of each sample, or the OSError that kept it from being keyed."""
        ...

    def key_rows(self, samples: Sequence[Sample]) -> np.ndarray | None:
        """Every sample's remembered keys at once (`KeyMemo.rows_all`), or None when some are not remembered."""
        ...

    def remember_keys(self) -> None:
        """Persist what was learnt about sample keys, so that the next start stats images instead of hashing."""
        ...


class EmbeddingSource(Protocol):
    # Whether `get` may run encoders: such a source stays in the training process (encoders may sit on
    # a GPU that forked loader workers cannot use) and is not read ahead by a prefetch thread.
    encodes: bool

    # The cache this source reads (and a lazy one writes); None for a source that reads none.
    cache: CacheReader | None

    def get(self, samples: Sequence[Sample]) -> list[SampleEmbeddings]: ...

    def with_encoding(self) -> EmbeddingSource:
        """A source that reads what this one reads and encodes what is missing (itself if it can)."""
        ...

    def release(self) -> None:
        """Free the encoders this source built (they are built again when needed)."""
        ...


class LiveSource:
    """Encodes every sample on every call."""

    encodes = True
    cache = None

    def __init__(self, encoder: Encoder, sizes: ImageSizes) -> None:
        self.encoder, self.sizes = encoder, sizes

    def get(self, samples: Sequence[Sample]) -> list[SampleEmbeddings]:
        return [
            from_entries(s.id, e, cached=False) for s, e in zip(samples, _encode(self.encoder, samples, self.sizes))
        ]

    def with_encoding(self) -> LiveSource:
        return self

    def release(self) -> None:
        pass  # the encoder is this source's reason to be


class CachedSource:
    """Reads the cache only; a missing entry stops with the sample's name and the precompute command.

    Args:
        encoder_factory: builds an encoder for `with_encoding()` (never called by this source itself).
        precompute_command: the command that fills this cache, quoted in the miss message.
        memo_dir: where sample keys are remembered by their inputs' signatures (`KeyMemo`); None keeps them
            in memory only.
    """

    encodes = False

    def __init__(
        self,
        backend: CacheStore,
        context: KeyContext,
        hasher: FileHasher,
        encoder_factory: EncoderFactory | None = None,
        sizes: ImageSizes | None = None,
        precompute_command: str = DEFAULT_PRECOMPUTE_COMMAND,
        memo_dir: str | None = None,
    ) -> None:
        self.backend, self.context, self.hasher = backend, context, hasher
        self.encoder_factory, self.sizes = encoder_factory, sizes
        self.precompute_command = precompute_command
        self.memo = KeyMemo(memo_dir, context, lambda s: sample_keys(s, self.context, self.hasher))

    @property
    def cache(self) -> CachedSource:
        """This source reads the cache itself."""
        return self

    def keys(self, sample: Sample) -> dict[str, str]:
        return self.memo.keys(sample)

    def keys_all(self, samples: Sequence[Sample]) -> list[dict[str, str] | OSError]:
        """`keys` of each sample, or the OSError that kept it from being keyed (see `KeyMemo.keys_all`)."""
        return self.memo.keys_all(samples)

    def key_rows(self, samples: Sequence[Sample]) -> np.ndarray | None:
        """Every sample's remembered keys at once, or None (see `KeyMemo.rows_all`)."""
        return self.memo.rows_all(samples)

    def remember_keys(self) -> None:
        """Persist what was learnt about sample keys (image hashes and keys by their inputs' signatures) in an
        existing cache folder; where it cannot be written, the next start computes them again."""
        folder = self.memo.path.parent.parent if self.memo.path is not None else None
        if folder is None or not folder.is_dir():
            return
        self.memo.save()
        try:
            self.hasher.save()
        except OSError as e:
            log.warning("could not save the image hash index %s (%s)", self.hasher.index_path, e)

    def read(self, sample: Sample) -> tuple[dict, list[str]]:
        """The sample's entries found in the cache, and the types that are missing."""
        return read_entries(self.backend, self.keys(sample), sample_types(sample))

    def miss(self, sample: Sample, missing: Sequence[str]) -> CacheMissError:
        """The error for `sample`'s `missing` types: absent, or stored but damaged (a failing checksum, a base
        that changed), which precompute writes again with cache.repair=true."""
        keys = self.keys(sample)
        damaged = [t for t in missing if self.backend.exists(t, keys[t])]
        # Judged whole (an index lists it) but not stored: deleted from the store behind the cache's back.
        gone = [t for t in missing if t not in damaged and self.backend.intact(t, keys[t])]
        if damaged:
            what = f"a damaged cached {', '.join(damaged)} (its bytes changed)"
        elif gone:
            what = f"no cached {', '.join(gone)} (the cache lists it, but its stored object was deleted)"
        else:
            what = f"no cached {', '.join(missing)}"
        return CacheMissError(
            f"sample {sample.id!r} ({sample.target}) has {what} in {self.backend!r}.\nFill the cache first with the "
            f"same model, data and cache settings:\n  {self.precompute_command}"
            f"{' cache.repair=true' if damaged or gone else ''}\n"
            "or train with cache.mode=lazy to encode what is missing."
        )

    def get(self, samples: Sequence[Sample]) -> list[SampleEmbeddings]:
        out = []
        for sample in samples:
            found, missing = self.read(sample)
            if missing:
                raise self.miss(sample, missing)
            out.append(from_entries(sample.id, found, cached=True))
        return out

    def with_encoding(self) -> LazySource:
        if self.encoder_factory is None or self.sizes is None:
            raise ValueError("this cached source was built without an encoder factory and image sizes")
        return LazySource(self, self.encoder_factory, self.sizes)

    def release(self) -> None:
        pass


class LazySource:
    """Reads the cache; encodes what is missing (in one batch) and writes it back.

    The encoder is built on the first miss, so a warm cache costs no encoder at all.
    """

    encodes = True

    def __init__(self, cached: CachedSource, encoder: Encoder | EncoderFactory, sizes: ImageSizes) -> None:
        self.cached, self.sizes = cached, sizes
        self._encoder = encoder if isinstance(encoder, Encoder) else None
        self._factory = None if isinstance(encoder, Encoder) else encoder

    @property
    def cache(self) -> CachedSource:
        return self.cached

    @property
    def encoder(self) -> Encoder:
        if self._encoder is None:
            self._encoder = self._factory()
        return self._encoder

    def get(self, samples: Sequence[Sample]) -> list[SampleEmbeddings]:
        results: list[SampleEmbeddings | None] = [None] * len(samples)
        todo = []
        for i, sample in enumerate(samples):
            found, missing = self.cached.read(sample)
            if missing:
                todo.append(i)
            else:
                results[i] = from_entries(sample.id, found, cached=True)
        if todo:
            entries = _encode(self.encoder, [samples[i] for i in todo], self.sizes)
            for i, entry in zip(todo, entries):
                self._write(samples[i], entry)
                results[i] = from_entries(samples[i].id, entry, cached=False)
        return results  # type: ignore[return-value]

    def with_encoding(self) -> LazySource:
        return self

    def release(self) -> None:
        if self._factory is not None:  # only what this source built itself
            self._encoder = None

    def _write(self, sample: Sample, entry: dict) -> None:
        write_entries(self.cached.backend, self.cached.keys(sample), entry)


def _encode(encoder: Encoder, samples: Sequence[Sample], sizes: ImageSizes) -> list[dict]:
    """Entries of the types each sample has, encoded in batches of samples that have the same types."""
    out: list[dict] = [{} for _ in samples]
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, sample in enumerate(samples):
        groups.setdefault(sample_types(sample), []).append(i)
    for types, idx in groups.items():
        prepared = [prepare_sample(samples[i], sizes) for i in idx]
        for i, entry in zip(idx, encoder.encode_entries(prepared, types)):
            out[i] = entry
    return out


def key_context(
    source: str,
    revision: str | None,
    spec: ModelSpec,
    sizes: ImageSizes,
    dtype: str = "float32",
    text_encoder_quantize: str = "none",
) -> KeyContext:
    """The KeyContext of a model, its dtype, text-encoder quantization and image sizes: fingerprints read from
    configs and weight headers.

    The prompt part's fingerprint is the processor's for the Edit pipelines and the tokenizer's for the
    text-to-image one (which has no processor).
    """
    from qie.components.fingerprint import part_fingerprint

    return KeyContext(
        vae_fingerprint=part_fingerprint(source, "vae", revision),
        text_encoder_fingerprint=part_fingerprint(source, "text_encoder", revision),
        prompt_template=spec.family.prompt_template(spec),
        target_pixels=sizes.target_pixels,
        resize_mode=sizes.resize_mode,
        multiple_of=sizes.multiple_of,
        vae_image_pixels=sizes.vae_image_pixels,
        vl_image_pixels=sizes.vl_image_pixels,
        dtype=dtype,
        processor_fingerprint=part_fingerprint(source, spec.prompt_parts[0], revision),
        text_encoder_quantize=text_encoder_quantize,
    )
