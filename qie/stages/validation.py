"""Validation inputs for training, taken through the run's EmbeddingSource.

With a warm cache (a previous run wrote them) cached training builds no encoder for validation either;
otherwise the source's encoding variant (`with_encoding()`) builds the encoders once, encodes, writes the
entries to the cache, and its encoders are freed before training starts.
"""

from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path

import torch

from qie.config.train import ValidationConfig
from qie.data.samples import Sample
from qie.embedding.sources import EmbeddingSource
from qie.models import ModelSpec
from qie.training.validation import Reference
from qie.types import SampleEmbeddings


def validation_samples(v: ValidationConfig, training: list[Sample], count: int) -> list[Sample]:
    """`validation.images` with `validation.prompts` (an Edit-Plus entry joins its images with '|'; no
    images for text to image), or, when none are given, the first `count` training samples. Those keep
    their targets: for the metrics, and, without a control image, for the output size (`validation_inputs`
    encodes the others without theirs). One entry per prompt, each with as many images as the model takes, was
    checked when the config was composed (`qie.checks.validate`).
    """
    if not v.prompts:
        return list(training[:count])
    images = list(v.images) or [""] * len(v.prompts)
    return [
        Sample(
            id=f"validation_{i}",
            target=None,
            controls=tuple(Path(p) for p in str(image).split("|") if p),
            prompt=str(prompt),
        )
        for i, (image, prompt) in enumerate(zip(images, v.prompts))
    ]


def validation_inputs(
    source: EmbeddingSource, samples: list[Sample], negative_prompt: str | None, encode: bool = True
) -> tuple[list[SampleEmbeddings], list[tuple[torch.Tensor, torch.Tensor | None] | None]]:
    """The encoded inputs of `samples` and, per sample, the negative prompt as (embedding, image mask).

    The empty negative prompt is the sample's own empty-prompt embedding; another one is encoded (and
    cached) as a prompt with the sample's control images; None gives None (no CFG). Without `encode`, what
    `source` does not hold is not encoded either: a cached source then refuses a miss (the eval stage's
    `cache.mode=cached`).

    Raises:
        CacheMissError: without `encode`, a sample whose entries `source` (a cached one) does not hold.
    """
    encoding = source.with_encoding() if encode else source
    # Sampling starts from the controls and the prompt; a target stays only where no control gives the size.
    samples = [replace(s, target=None) if s.controls else s for s in samples]
    inputs = encoding.get(samples)
    if negative_prompt is None:
        negatives = [None] * len(inputs)
    elif negative_prompt == "":
        negatives = [(s.empty_prompt_embed, s.empty_prompt_image_mask) for s in inputs]
    else:
        encoded = encoding.get([replace(s, prompt=negative_prompt) for s in samples])
        negatives = [(e.prompt_embed, e.prompt_image_mask) for e in encoded]
    if encoding is not source:  # encoders built only for validation: free them before training
        encoding.release()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return inputs, negatives


def validation_references(samples: list[Sample], spec: ModelSpec) -> list[Reference]:
    """Per validation sample, what its edit metrics compare with: the control image the output's size follows
    (`ModelSpec.output_image`) and the target, where the sample has them, and its prompt."""
    return [Reference(s.controls[spec.output_image or 0] if s.controls else None, s.target, s.prompt) for s in samples]
