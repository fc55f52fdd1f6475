"""Validation images during training: fixed inputs, fixed seeds, the shared denoising loop.

Inputs arrive encoded (prompt and empty-prompt embeddings, control latents), so validation in cached
mode needs only the transformer, the scheduler and the VAE decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qie.sampling import decode_latents, pad_prompt_embeds, sample_latents, vae_scale_factor
from qie.training.logging import MetricsLogger


@dataclass
class ValidationInput:
    id: str
    prompt_embed: torch.Tensor  # (tokens, dim)
    empty_prompt_embed: torch.Tensor  # (tokens, dim): the negative prompt for CFG
    control_latents: list[torch.Tensor]  # each (C, 1, h, w)


class Validator:
    """Samples each input with the current transformer and logs the images as one grid.

    Args:
        inputs: encoded validation inputs.
        scheduler, vae: the model's scheduler and VAE (only its decoder is used).
        steps, true_cfg_scale, seed: sampling settings; CFG uses the empty prompt as negative.
    """

    def __init__(
        self,
        inputs: list[ValidationInput],
        scheduler,
        vae,
        logger: MetricsLogger,
        steps: int = 20,
        true_cfg_scale: float = 1.0,
        seed: int = 0,
    ) -> None:
        self.inputs, self.scheduler, self.vae, self.logger = inputs, scheduler, vae, logger
        self.steps, self.true_cfg_scale, self.seed = steps, true_cfg_scale, seed

    @torch.no_grad()
    def images(self, transformer: torch.nn.Module) -> list:
        f = vae_scale_factor(self.vae)
        out = []
        was_training = transformer.training
        transformer.eval()
        dtype = next(transformer.parameters()).dtype
        for n, item in enumerate(self.inputs):
            embeds, mask = pad_prompt_embeds([item.prompt_embed.to(dtype)])
            neg, neg_mask = pad_prompt_embeds([item.empty_prompt_embed.to(dtype)])
            _, _, _, h, w = (1, *item.control_latents[0].shape)
            latents = sample_latents(
                transformer,
                self.scheduler,
                embeds,
                mask,
                [c.unsqueeze(0) for c in item.control_latents],
                height=h * f,
                width=w * f,
                vae_scale_factor=f,
                num_inference_steps=self.steps,
                generator=torch.Generator("cpu").manual_seed(self.seed + n),
                negative_prompt_embeds=neg if self.true_cfg_scale > 1 else None,
                negative_prompt_embeds_mask=neg_mask if self.true_cfg_scale > 1 else None,
                true_cfg_scale=self.true_cfg_scale,
            )
            out += decode_latents(self.vae, latents)
        transformer.train(was_training)
        return out

    def __call__(self, step: int, transformer: torch.nn.Module) -> list:
        images = self.images(transformer)
        self.logger.log_images("validation", images, step)
        return images
