"""The training step: flow-matching loss of Qwen-Image-Edit on one batch.

It receives tensors only: it imports neither the cache nor the encoders, and never knows whether a batch
was read from the cache or encoded live.

x_t = (1 - σ)·x0 + σ·noise, target = noise - x0. The target's packed tokens come first in the image
sequence, each control image's tokens follow, `img_shapes` lists the target's shape then each control's,
and the prediction is cut to the target's tokens.
"""

from __future__ import annotations

import torch
from diffusers import QwenImageEditPipeline

from qie.models.flow import noisy_latents, velocity_loss
from qie.types import Batch

pack_latents = QwenImageEditPipeline._pack_latents


def packed(latents: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(B, C, 1, h, w) -> (B, h/2 * w/2, 4C) tokens, and the (1, h/2, w/2) shape the rotary embedding uses."""
    b, c, _, h, w = latents.shape
    return pack_latents(latents[:, :, 0], b, c, h, w), (1, h // 2, w // 2)


def flow_matching_loss(
    transformer: torch.nn.Module,
    batch: Batch,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    weighting: str = "none",
) -> torch.Tensor:
    """Mean weighted squared error between the predicted and the true velocity (noise - x0).

    Args:
        transformer: QwenImageTransformer2DModel (with or without LoRA), on the batch's device.
        batch: latents and prompt embeddings, on the transformer's device.
        noise: like batch.latents.
        sigmas: (B,) noise levels in (0, 1]; the transformer is given σ as its timestep.
    """
    x0 = batch.latents
    noisy, target_shape = packed(noisy_latents(x0, noise, sigmas))
    controls = [packed(c) for c in batch.control_latents]
    hidden = torch.cat([noisy] + [tokens for tokens, _ in controls], dim=1)
    img_shapes = [[target_shape] + [shape for _, shape in controls]] * x0.shape[0]
    pred = transformer(
        hidden_states=hidden,
        timestep=sigmas.to(x0.device, x0.dtype),
        encoder_hidden_states=batch.prompt_embeds,
        encoder_hidden_states_mask=batch.prompt_embeds_mask,
        img_shapes=img_shapes,
        return_dict=False,
    )[0][:, : noisy.shape[1]]
    target, _ = packed(noise - x0)
    mask = None if batch.loss_mask is None else packed(batch.loss_mask.expand_as(x0))[0]
    return velocity_loss(pred, target, sigmas, weighting, mask)
