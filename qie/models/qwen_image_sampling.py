"""The Qwen-Image family's sampling: the pipelines' denoising loop over already-encoded inputs, and decoding.

Follows diffusers 0.42.1's `QwenImageEditPipeline`, `QwenImageEditPlusPipeline` and `QwenImagePipeline`: sigmas
linspace(1, 1/N), the scheduler's dynamic shift, true CFG rescaled to the conditional norm; the target's tokens come
first, each control image's follow, and the prediction is cut to the target's tokens. `qie.models.qwen_image` holds
the family's other pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers import QwenImageEditPipeline
from diffusers.image_processor import VaeImageProcessor

from qie.models.flow import predict
from qie.models.flow_family import FlowLoop
from qie.models.sampling import Prediction, PromptInputs, SamplingOptions, initial_noise
from qie.types import pad_prompt_embeds

pack_latents = QwenImageEditPipeline._pack_latents
_unpack_latents = QwenImageEditPipeline._unpack_latents


def vae_scale(vae: Any) -> int:
    """Pixels per latent along a side (8 for Qwen-Image's VAE), computed as the pipelines do."""
    return 2 ** len(vae.temperal_downsample)


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
    """Denoise from noise to the latents of the image, step for step as the Qwen-Image pipelines' `__call__`.

    Runs on the transformer's device; inputs may live anywhere. The scheduler is not modified (a fresh one is made
    from its config), so one scheduler can serve training and validation.

    Args:
        transformer: QwenImageTransformer2DModel (LoRA or not).
        scheduler: FlowMatchEulerDiscreteScheduler of the model (its config decides the shift).
        prompt_embeds: (B, L, dim); B is the number of images made.
        prompt_embeds_mask: (B, L) 1/0, or None when nothing is padded (see `pad_prompt_embeds`).
        control_latents: normalised VAE latents, each (B or 1, C, 1, h, w), in the images' order (none for T2I).
        height, width: output size in pixels, multiples of `2 * vae_scale_factor`.
        vae_scale_factor: pixels per latent (see `vae_scale()`).
        num_inference_steps: denoising steps.
        generator: draws the initial noise, of shape (B, 1, C, h, w) as the pipelines draw it.
        negative_prompt_embeds, negative_prompt_embeds_mask: the unconditional branch of true CFG.
        true_cfg_scale: CFG runs when > 1 and negative embeddings are given.
        progress: show progress (a bar on a terminal, plain lines in a log).

    Returns:
        Normalised latents (B, C, 1, height / f, width / f), for `decode_latents`.
    """
    device = transformer.device
    dtype = prompt_embeds.dtype  # the pipelines draw noise in the prompt embeddings' dtype
    channels = transformer.config.in_channels // 4
    lat_h, lat_w = 2 * (int(height) // (vae_scale_factor * 2)), 2 * (int(width) // (vae_scale_factor * 2))
    noise = initial_noise((prompt_embeds.shape[0], channels, 1, lat_h, lat_w), generator, device, dtype)
    negative = None
    if negative_prompt_embeds is not None:
        negative = PromptInputs(_to(negative_prompt_embeds, device), _to(negative_prompt_embeds_mask, device))
    prompt = PromptInputs(_to(prompt_embeds, device), _to(prompt_embeds_mask, device))
    return QwenImageLoop.denoise(
        transformer,
        scheduler,
        noise,
        prompt=prompt,
        negative=negative,
        controls=control_latents,
        steps=num_inference_steps,
        true_cfg_scale=true_cfg_scale,
        progress=progress,
    )


class QwenImageLoop(FlowLoop):
    """The pipelines' denoising run (`FlowLoop.denoise` is the family's `denoise`): the target's tokens, then each
    control image's; sigmas linspace(1, 1/N) shifted for the target's length; true CFG rescaled to the conditional
    prediction's norm."""

    sigma_schedule = "linspace_to_1_over_n"
    rescale = True

    def __init__(self, transformer: Any, noise: torch.Tensor, controls: Sequence[torch.Tensor]) -> None:
        batch, channels, _, lat_h, lat_w = noise.shape
        self.transformer, self.size = transformer, (lat_h, lat_w)
        self.latents = pack_latents(noise[:, :, 0], batch, channels, lat_h, lat_w)
        self.image_latents, shapes = _packed_controls(controls, batch, channels, noise.device, noise.dtype)
        self.img_shapes = [[(1, lat_h // 2, lat_w // 2), *shapes]] * batch

    def prediction(self, inputs: PromptInputs, name: str) -> Prediction:
        def call(i: int, t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
            model_input = latents if self.image_latents is None else torch.cat([latents, self.image_latents], dim=1)
            timestep = t.expand(latents.shape[0]).to(latents.dtype) / 1000
            # Control tokens follow the target's in the sequence; only the target's are denoised.
            return predict(
                self.transformer,
                name,
                hidden_states=model_input,
                timestep=timestep,
                guidance=None,
                encoder_hidden_states=inputs.embeds,
                encoder_hidden_states_mask=inputs.mask,
                img_shapes=self.img_shapes,
                attention_kwargs={},
            )[:, : latents.size(1)]

        return call

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        return _unpack_latents(latents, *self.size, 1)


def _packed_controls(control_latents: Sequence[torch.Tensor], batch: int, channels: int, device, dtype):
    """The control latents' tokens, one sequence after another, repeated to `batch` (None without controls), and
    each control's (1, h/2, w/2) rotary shape."""
    controls, shapes = [], []
    for control in control_latents:
        control = control.to(device=device, dtype=dtype)
        if control.shape[0] != batch:
            control = torch.cat([control] * (batch // control.shape[0]), dim=0)
        h, w = control.shape[3:]
        controls.append(pack_latents(control, batch, channels, h, w))
        shapes.append((1, h // 2, w // 2))
    return (torch.cat(controls, dim=1) if controls else None), shapes


def _to(x: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if x is None else x.to(device)


def sample(
    parts: Any,
    prompt: tuple[torch.Tensor, torch.Tensor | None],
    negative: tuple[torch.Tensor, torch.Tensor | None] | None,
    controls: Sequence[torch.Tensor],
    size: tuple[int, int],
    options: SamplingOptions,
    progress: bool = False,
) -> torch.Tensor:
    """Latents of `options.num_images` images from one sample's encoded inputs, as the pipelines make them.

    Args:
        parts: the built parts; their transformer, scheduler and VAE (for its scale factor) are used.
        prompt, negative: (unpadded (tokens, dim) embedding, image mask (unused here)); the negative one
            is used only when `options.guidance`.
        controls: normalised latents, each (C, 1, h, w), in the order of the images (may be none).
        size: (height, width) of the output in pixels (`ModelSpec.output_size`), rounded down to whole
            latent patches as the pipelines round it.
        options: resolved sampling options (`SamplingOptions.resolved`).
    """
    copies, guidance = options.num_images, options.guidance
    scale = vae_scale(parts.vae)
    multiple = scale * 2
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
        [c.unsqueeze(0) for c in controls],
        height=height,
        width=width,
        vae_scale_factor=scale,
        num_inference_steps=options.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(int(options.seed)),
        negative_prompt_embeds=neg,
        negative_prompt_embeds_mask=neg_mask,
        true_cfg_scale=options.true_cfg_scale if guidance else 1.0,
        progress=progress,
    )


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
    processor = VaeImageProcessor(vae_scale_factor=vae_scale(vae) * 2)
    return processor.postprocess(images, output_type=output_type)
