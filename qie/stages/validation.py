"""Validation inputs for training: encoded once, read from the cache when they are there.

With a warm cache (a previous run wrote them) cached training builds no encoder for validation either;
otherwise the encoders are built once, used, written to the cache and freed before training starts.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from omegaconf import DictConfig

from qie.data.keys import sample_keys
from qie.data.samples import Sample
from qie.embeddings import CachedSource, EmbeddingSource, LazySource, LiveSource
from qie.encode import prepare_sample
from qie.stages.common import build_encoder, image_sizes
from qie.training.validation import ValidationInput

TYPES = ("control_latent", "prompt_embed", "empty_prompt_embed")


def validation_samples(cfg: DictConfig, training: list[Sample]) -> list[Sample]:
    """`validation.images` with `validation.prompts` (an Edit-Plus entry joins its images with '|'),
    or, when none are given, the first `logging.log_images_count` training samples."""
    v = cfg.validation
    if v.prompts:
        if len(v.images) != len(v.prompts):
            from qie.errors import ConfigError

            raise ConfigError(
                f"validation.images has {len(v.images)} entries and validation.prompts {len(v.prompts)}: "
                "give one image (or 'a.png|b.png' for Edit-Plus) per prompt"
            )
        return [
            Sample(f"validation_{i}", None, tuple(Path(p) for p in str(img).split("|")), str(prompt))
            for i, (img, prompt) in enumerate(zip(v.images, v.prompts))
        ]
    return [Sample(s.id, None, s.controls, s.prompt) for s in training[: int(cfg.logging.log_images_count)]]


def validation_inputs(cfg: DictConfig, source: EmbeddingSource, samples: list[Sample]) -> list[ValidationInput]:
    """Encoded inputs for `samples`: from the cache where present, else encoded (and cached)."""
    cached = source.cached if isinstance(source, LazySource) else source if isinstance(source, CachedSource) else None
    encoder = source.encoder if isinstance(source, (LazySource, LiveSource)) else None
    own_encoder = False
    out = []
    for sample in samples:
        keys = sample_keys(sample, cached.context, cached.hasher) if cached else {}
        entries = {t: cached.backend.get(t, keys[t]) for t in TYPES} if cached else {}
        if not entries or any(e is None for e in entries.values()):
            if encoder is None:
                encoder, own_encoder = build_encoder(cfg), True
            entries = encoder.encode_entries([prepare_sample(sample, image_sizes(cfg))], TYPES)[0]
            if cached:
                for t, tensors in entries.items():
                    cached.backend.put(t, keys[t], tensors)
        controls = entries["control_latent"]
        out.append(
            ValidationInput(
                sample.id,
                entries["prompt_embed"]["embed"],
                entries["empty_prompt_embed"]["embed"],
                [controls[str(k)] for k in range(len(controls))],
            )
        )
    if own_encoder:
        del encoder
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out
