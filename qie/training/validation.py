"""Validation images during training: fixed inputs, fixed seeds, the sampling code inference uses.

Inputs arrive encoded (SampleEmbeddings; a target latent only where it sets the output size), so
validation in cached mode needs only the transformer, the scheduler and the VAE decoder.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from qie.models import ModelSpec
from qie.sampling import SamplingOptions, decode_latents, latent_sizes, sample_edit, vae_scale_factor
from qie.training.logging import MetricsLogger
from qie.types import SampleEmbeddings


class Validator:
    """Samples each input with the current transformer and logs the images as one grid.

    Args:
        inputs: encoded validation inputs; `negatives[i]` is input i's negative prompt embedding (or None).
        scheduler, vae: the model's scheduler and VAE (only its decoder is used).
        options: sampling options; input i is sampled with seed `options.seed + i`.
        spec: the model description, whose `output_size` rule sizes each output (from the options, the
            input's control images, or its target's size when it has no control image).
    """

    def __init__(
        self,
        inputs: list[SampleEmbeddings],
        negatives: list[torch.Tensor | None],
        scheduler,
        vae,
        logger: MetricsLogger | None,
        options: SamplingOptions,
        spec: ModelSpec,
    ) -> None:
        self.inputs, self.negatives, self.scheduler, self.vae = inputs, negatives, scheduler, vae
        self.logger, self.options, self.spec = logger, options, spec

    @torch.no_grad()
    def images(self, transformer: torch.nn.Module) -> list:
        f = vae_scale_factor(self.vae)
        out = []
        was_training = transformer.training
        transformer.eval()
        for n, (item, negative) in enumerate(zip(self.inputs, self.negatives)):
            options = replace(self.options, seed=self.options.seed + n)
            target = latent_sizes([item.pixel_latent], f)[0] if item.pixel_latent is not None else None
            size = self.spec.output_size(
                options.height, options.width, latent_sizes(item.control_latents, f), target, f
            )
            latents = sample_edit(
                transformer, self.scheduler, f, item.prompt_embed, negative, item.control_latents, size, options
            )
            out += decode_latents(self.vae, latents)
        transformer.train(was_training)
        return out

    def __call__(self, step: int, transformer: torch.nn.Module) -> list:
        images = self.images(transformer)
        if self.logger is not None:
            self.logger.log_images("validation", images, step)
        return images
