"""The denoising loop of Qwen-Image (Edit, Edit-Plus, text-to-image), shared by inference and validation.

It starts from already-encoded inputs (prompt embeddings, normalised control latents, possibly none), so
validation in cached mode can feed cached tensors, and it reproduces `QwenImageEditPipeline.__call__`,
`QwenImageEditPlusPipeline.__call__` and `QwenImagePipeline.__call__` step for step, through diffusers' own
helpers: the same noise from the same generator, the same sigmas and shift, the same true-CFG rescale and
scheduler steps. With no control latents it is the text-to-image loop (an Edit-Plus model without an input
image runs it too: diffusers' own `__call__(image=None)` fails in 0.42.1).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import (
    QwenImageEditPipeline,
    retrieve_timesteps,
)
from diffusers.utils.torch_utils import randn_tensor

from qie.models.flow import shift_mu
from qie.progress import progress as progress_bar
from qie.types import pad_prompt_embeds

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingOptions:
    """How an image is sampled; one set of defaults for `python -m qie.infer`, `Trainer.predict` and
    validation (the `predict` config group fills it; `validation.*` may override some fields).

    The default negative prompt is the empty prompt: its embedding is what the cache stores for every
    sample, so validation runs classifier-free guidance from cached inputs. `None` turns CFG off.
    The CFG scale and the step count left None are the model's pipeline's own defaults (`resolved`).
    """

    negative_prompt: str | None = ""
    true_cfg_scale: float | None = None
    num_inference_steps: int | None = None
    seed: int = 0
    # Output size; None: the model's rule (the condition size of its output image, see ModelSpec.output_size).
    height: int | None = None
    width: int | None = None
    num_images: int = 1

    @property
    def guidance(self) -> bool:
        """Whether true CFG runs with these options (diffusers' rule: a scale above 1 and a negative prompt)."""
        if self.true_cfg_scale is None:
            raise ValueError("SamplingOptions.true_cfg_scale is not resolved: call resolved(spec.call_defaults())")
        return true_cfg_enabled(self.true_cfg_scale, self.negative_prompt is not None, bool(self.negative_prompt))

    def resolved(self, defaults: Mapping[str, Any]) -> SamplingOptions:
        """These options, the fields left None taken from `defaults` (`ModelSpec.call_defaults()`)."""
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k, 0) is None})


_pack_latents = QwenImageEditPipeline._pack_latents
_unpack_latents = QwenImageEditPipeline._unpack_latents


def vae_scale_factor(vae: Any) -> int:
    """Pixels per latent along a side (8 for Qwen-Image's VAE), computed as the pipelines do."""
    return 2 ** len(vae.temperal_downsample)


def true_cfg_enabled(true_cfg_scale: float, has_negative: bool, warn_unused_negative: bool = True) -> bool:
    """Whether true CFG runs: only with a scale above 1 *and* a negative prompt; warns as diffusers does
    (the warning for a negative prompt left unused can be turned off: the default empty one is no choice)."""
    if true_cfg_scale > 1 and not has_negative:
        logger.warning(
            f"true_cfg_scale is {true_cfg_scale}, but classifier-free guidance is not enabled since no "
            "negative prompt is given (set predict.negative_prompt, e.g. to ' ')"
        )
    elif true_cfg_scale <= 1 and has_negative and warn_unused_negative:
        logger.warning("a negative prompt is given, but classifier-free guidance is off since true_cfg_scale <= 1")
    return true_cfg_scale > 1 and has_negative


def _cache_context(transformer: Any, name: str):
    # The pipelines name each call for diffusers' cache hooks; a wrapped model may lack the method.
    context = getattr(transformer, "cache_context", None)
    return context(name) if context is not None else nullcontext()


def _predict(transformer, latents, model_input, embeds, mask, timestep, img_shapes, name) -> torch.Tensor:
    with _cache_context(transformer, name):
        pred = transformer(
            hidden_states=model_input,
            timestep=timestep / 1000,
            guidance=None,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=embeds,
            img_shapes=img_shapes,
            attention_kwargs={},
            return_dict=False,
        )[0]
    # Control tokens follow the target's in the sequence; only the target's are denoised.
    return pred[:, : latents.size(1)]


@torch.no_grad()
def sample_latents(
    transformer: Any,
    scheduler: Any,
    prompt_embeds: torch.Tensor,
    prompt_embeds_mask: torch.Tensor | None,
    control_latents: Sequence[torch.Tensor],
    height: int,
    width: int,
    vae_scale_factor: int,
    num_inference_steps: int,
    generator: torch.Generator | None,
    negative_prompt_embeds: torch.Tensor | None = None,
    negative_prompt_embeds_mask: torch.Tensor | None = None,
    true_cfg_scale: float = 1.0,
    progress: bool = False,
) -> torch.Tensor:
    """Denoise from noise to the latents of the image, as the Qwen-Image pipelines do.

    Runs on the transformer's device; inputs may live anywhere. The scheduler is not modified (a fresh
    one is made from its config), so one scheduler can serve training and validation.

    Args:
        transformer: QwenImageTransformer2DModel (LoRA or not).
        scheduler: FlowMatchEulerDiscreteScheduler of the model (its config decides the shift).
        prompt_embeds: (B, L, dim); B is the number of images made.
        prompt_embeds_mask: (B, L) 1/0, or None when nothing is padded (see `pad_prompt_embeds`).
        control_latents: normalised VAE latents, each (B or 1, C, 1, h, w), in the order of the images
            (none for text to image).
        height, width: output size in pixels, multiples of `2 * vae_scale_factor`.
        vae_scale_factor: pixels per latent (see `vae_scale_factor()`).
        num_inference_steps: denoising steps.
        generator: draws the initial noise, of shape (B, 1, C, h, w) as the pipelines draw it.
        negative_prompt_embeds, negative_prompt_embeds_mask: the unconditional branch of true CFG.
        true_cfg_scale: CFG runs when > 1 and negative embeddings are given.
        progress: show a progress bar.

    Returns:
        Normalised latents (B, C, 1, height / f, width / f), for `decode_latents`.
    """
    device = transformer.device
    dtype = prompt_embeds.dtype  # the pipelines draw noise in the prompt embeddings' dtype
    batch = prompt_embeds.shape[0]
    channels = transformer.config.in_channels // 4
    lat_h, lat_w = 2 * (int(height) // (vae_scale_factor * 2)), 2 * (int(width) // (vae_scale_factor * 2))
    do_cfg = true_cfg_enabled(true_cfg_scale, negative_prompt_embeds is not None)

    embeds, mask = _to(prompt_embeds, device), _to(prompt_embeds_mask, device)
    neg_embeds, neg_mask = _to(negative_prompt_embeds, device), _to(negative_prompt_embeds_mask, device)

    noise = randn_tensor((batch, 1, channels, lat_h, lat_w), generator=generator, device=device, dtype=dtype)
    latents = _pack_latents(noise, batch, channels, lat_h, lat_w)
    shapes = [(1, lat_h // 2, lat_w // 2)]
    packed = []
    for control in control_latents:
        control = control.to(device=device, dtype=dtype)
        if control.shape[0] != batch:
            control = torch.cat([control] * (batch // control.shape[0]), dim=0)
        h, w = control.shape[3:]
        packed.append(_pack_latents(control, batch, channels, h, w))
        shapes.append((1, h // 2, w // 2))
    image_latents = torch.cat(packed, dim=1) if packed else None
    img_shapes = [shapes] * batch

    scheduler = type(scheduler).from_config(scheduler.config)
    sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
    mu = shift_mu(latents.shape[1], scheduler.config)
    timesteps, _ = retrieve_timesteps(scheduler, num_inference_steps, device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)

    bar = progress_bar(len(timesteps), "denoise", disable=not progress)
    for t in timesteps:
        model_input = latents if image_latents is None else torch.cat([latents, image_latents], dim=1)
        timestep = t.expand(batch).to(latents.dtype)
        pred = _predict(transformer, latents, model_input, embeds, mask, timestep, img_shapes, "cond")
        if do_cfg:
            neg = _predict(transformer, latents, model_input, neg_embeds, neg_mask, timestep, img_shapes, "uncond")
            combined = neg + true_cfg_scale * (pred - neg)
            # Rescale to the conditional prediction's norm, token by token, as Qwen-Image does.
            pred = combined * (torch.norm(pred, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
        bar.update(1)
    bar.close()
    return _unpack_latents(latents, height, width, vae_scale_factor)


def _to(x: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if x is None else x.to(device)


@torch.no_grad()
def decode_latents(vae: Any, latents: torch.Tensor, output_type: str = "pil") -> Any:
    """Images from normalised latents (B, C, 1, h, w): denormalise, VAE-decode, postprocess.

    Args:
        vae: AutoencoderKLQwenImage; decoding runs on its device and dtype.
        latents: as `sample_latents` returns them.
        output_type: "pil" (list of images), "np" (float array (B, H, W, 3) in [0, 1]) or "pt".
    """
    latents = latents.to(device=vae.device, dtype=vae.dtype)
    z_dim = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
    # Divide by 1/std (not multiply by std) exactly as the pipelines do, so results agree to the last bit.
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
    images = vae.decode(latents / inv_std + mean, return_dict=False)[0][:, :, 0]
    processor = VaeImageProcessor(vae_scale_factor=vae_scale_factor(vae) * 2)
    return processor.postprocess(images, output_type=output_type)


def sample_edit(
    parts: Any,
    prompt: tuple[torch.Tensor, torch.Tensor | None],
    negative: tuple[torch.Tensor, torch.Tensor | None] | None,
    control_latents: Sequence[torch.Tensor],
    size: tuple[int, int],
    options: SamplingOptions,
    progress: bool = False,
) -> torch.Tensor:
    """Latents of `options.num_images` images from one sample's encoded inputs, as the pipelines make them.

    Args:
        parts: the built parts; their transformer, scheduler and VAE (for its scale factor) are used.
        prompt, negative: (unpadded (tokens, dim) embedding, image mask (unused here)); the negative one
            is used only when `options.guidance`.
        control_latents: normalised latents, each (C, 1, h, w), in the order of the images (may be none).
        size: (height, width) of the output in pixels (`ModelSpec.output_size`), rounded down to whole
            latent patches as the pipelines round it.
        options: resolved sampling options (`SamplingOptions.resolved`).
    """
    copies, guidance = options.num_images, options.guidance
    vae_scale = vae_scale_factor(parts.vae)
    multiple = vae_scale * 2
    height, width = int(size[0]) // multiple * multiple, int(size[1]) // multiple * multiple
    embeds, mask = pad_prompt_embeds([prompt[0]] * copies)
    neg = neg_mask = None
    if guidance:
        neg, neg_mask = pad_prompt_embeds([negative[0]] * copies)
    return sample_latents(
        parts.transformer,
        parts.scheduler,
        embeds,
        mask,
        [c.unsqueeze(0) for c in control_latents],
        height=height,
        width=width,
        vae_scale_factor=vae_scale,
        num_inference_steps=options.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(int(options.seed)),
        negative_prompt_embeds=neg,
        negative_prompt_embeds_mask=neg_mask,
        true_cfg_scale=options.true_cfg_scale if guidance else 1.0,
        progress=progress,
    )


def latent_sizes(latents: Sequence[torch.Tensor], vae_scale: int) -> list[tuple[int, int]]:
    """(height, width) in pixels of images whose latents are (..., h, w)."""
    return [(vae_scale * int(x.shape[-2]), vae_scale * int(x.shape[-1])) for x in latents]
