"""EmbeddingSource: one interface from samples to the tensors a training step needs.

`cached` reads the cache only (no encoder is ever built), `live` encodes every time, `lazy` reads the
cache and encodes + writes what is missing. The training step sees `SampleEmbeddings` and never knows
which source produced them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from qie.cache.base import CacheBackend
from qie.cache.keys import FileHasher
from qie.data.keys import KeyContext, sample_keys
from qie.data.samples import Sample
from qie.encode import Encoder, ImageSizes, prepare_sample
from qie.errors import CacheMissError

# What a training step needs of a sample (the masks are implied: embeddings are stored unpadded).
TRAINING_TYPES = ("pixel_latent", "control_latent", "prompt_embed", "empty_prompt_embed")


@dataclass
class SampleEmbeddings:
    """A sample's encoded inputs, on the CPU, unpadded."""

    id: str
    pixel_latent: torch.Tensor  # (C, 1, h, w), normalised
    control_latents: tuple[torch.Tensor, ...]  # each (C, 1, h, w), normalised
    prompt_embed: torch.Tensor  # (tokens, dim)
    empty_prompt_embed: torch.Tensor  # (tokens, dim), the same control images with the empty prompt
    cached: bool = False

    @classmethod
    def from_entries(cls, sample_id: str, entries: dict, cached: bool) -> SampleEmbeddings:
        controls = entries["control_latent"]
        return cls(
            id=sample_id,
            pixel_latent=entries["pixel_latent"]["latent"],
            control_latents=tuple(controls[str(k)] for k in range(len(controls))),
            prompt_embed=entries["prompt_embed"]["embed"],
            empty_prompt_embed=entries["empty_prompt_embed"]["embed"],
            cached=cached,
        )


class EmbeddingSource(Protocol):
    def get(self, samples: Sequence[Sample]) -> list[SampleEmbeddings]: ...


class LiveSource:
    """Encodes every sample on every call."""

    def __init__(self, encoder: Encoder, sizes: ImageSizes) -> None:
        self.encoder, self.sizes = encoder, sizes

    def get(self, samples: Sequence[Sample]) -> list[SampleEmbeddings]:
        entries = self.encoder.encode_entries([prepare_sample(s, self.sizes) for s in samples], TRAINING_TYPES)
        return [SampleEmbeddings.from_entries(s.id, e, cached=False) for s, e in zip(samples, entries)]


class CachedSource:
    """Reads the cache only; a missing entry stops with the sample's name and the precompute command.

    Args:
        precompute_command: the command that fills this cache, quoted in the miss message.
    """

    def __init__(
        self,
        backend: CacheBackend,
        context: KeyContext,
        hasher: FileHasher,
        precompute_command: str = "python -m qie.precompute model=... data.path=... cache.dir=...",
    ) -> None:
        self.backend, self.context, self.hasher = backend, context, hasher
        self.precompute_command = precompute_command

    def read(self, sample: Sample) -> tuple[dict, list[str]]:
        """The sample's entries found in the cache, and the types that are missing."""
        keys = sample_keys(sample, self.context, self.hasher)
        found, missing = {}, []
        for kind in TRAINING_TYPES:
            entry = self.backend.get(kind, keys[kind])
            if entry is None:
                missing.append(kind)
            else:
                found[kind] = entry
        return found, missing

    def check(self, samples: Sequence[Sample]) -> None:
        """Stop at the first sample with no entry of a training type, reading nothing but file metadata.

        Raises:
            CacheMissError: naming the sample, what is missing and the precompute command.
        """
        for sample in samples:
            keys = sample_keys(sample, self.context, self.hasher)
            missing = [kind for kind in TRAINING_TYPES if not self.backend.exists(kind, keys[kind])]
            if missing:
                raise self.miss(sample, missing)

    def miss(self, sample: Sample, missing: Sequence[str]) -> CacheMissError:
        return CacheMissError(
            f"sample {sample.id!r} ({sample.target}) has no cached {', '.join(missing)} in {self.backend!r}.\n"
            "Fill the cache first with the same model, data and cache settings:\n"
            f"  {self.precompute_command}\n"
            "or train with cache.mode=lazy to encode what is missing."
        )

    def get(self, samples: Sequence[Sample]) -> list[SampleEmbeddings]:
        out = []
        for sample in samples:
            found, missing = self.read(sample)
            if missing:
                raise self.miss(sample, missing)
            out.append(SampleEmbeddings.from_entries(sample.id, found, cached=True))
        return out


class LazySource:
    """Reads the cache; encodes what is missing (in one batch) and writes it back."""

    def __init__(self, cached: CachedSource, encoder: Encoder, sizes: ImageSizes) -> None:
        self.cached, self.encoder, self.sizes = cached, encoder, sizes

    def get(self, samples: Sequence[Sample]) -> list[SampleEmbeddings]:
        results: list[SampleEmbeddings | None] = [None] * len(samples)
        todo = []
        for i, sample in enumerate(samples):
            found, missing = self.cached.read(sample)
            if missing:
                todo.append(i)
            else:
                results[i] = SampleEmbeddings.from_entries(sample.id, found, cached=True)
        if todo:
            prepared = [prepare_sample(samples[i], self.sizes) for i in todo]
            entries = self.encoder.encode_entries(prepared, TRAINING_TYPES)
            for i, entry in zip(todo, entries):
                self._write(samples[i], entry)
                results[i] = SampleEmbeddings.from_entries(samples[i].id, entry, cached=False)
        return results  # type: ignore[return-value]

    def _write(self, sample: Sample, entry: dict) -> None:
        keys = sample_keys(sample, self.cached.context, self.cached.hasher)
        for kind, tensors in entry.items():
            self.cached.backend.put(kind, keys[kind], tensors)


def prompt_template(variant: str) -> str:
    """The prompt template and drop index of the variant's diffusers pipeline, as one string for keys."""
    from qie.components import Parts, edit_pipeline

    pipe = edit_pipeline(Parts(), variant)
    return f"{pipe.prompt_template_encode}|{pipe.prompt_template_encode_start_idx}"


def key_context(
    source: str, revision: str | None, variant: str, sizes: ImageSizes, dtype: str = "float32"
) -> KeyContext:
    """The KeyContext of a model, its dtype and image sizes: fingerprints read from configs and weight headers."""
    from qie.components.fingerprint import part_fingerprint

    return KeyContext(
        vae_fingerprint=part_fingerprint(source, "vae", revision),
        text_encoder_fingerprint=part_fingerprint(source, "text_encoder", revision),
        prompt_template=prompt_template(variant),
        target_pixels=sizes.target_pixels,
        resize_mode=sizes.resize_mode,
        multiple_of=sizes.multiple_of,
        vae_image_pixels=sizes.vae_image_pixels,
        vl_image_pixels=sizes.vl_image_pixels,
        dtype=dtype,
        processor_fingerprint=part_fingerprint(source, "processor", revision),
    )
