"""Qwen-Image-2.1: text-to-image and editing with up to 10 reference images, through `QwenImage21Pipeline`.

What differs from Qwen-Image-Edit, all read from diffusers 0.42.1's pipeline and transformer:
- Prompts: Qwen3-VL sees the prompt and every reference image (RGBA composited on white for it only); the
  pipeline's `encode_prompt` returns the embeddings and an image-pad mask (which positions are image slots).
- Latents: 64 channels from an RGBA VAE (16x down), taken unpatched: one token per latent pixel, one image
  slot of the prompt per 2x2 tokens.
- Transformer: one joint sequence; reference tokens fill the prompt's image slots, the target's tokens are
  appended (`img_mask` = image-pad mask + one slot per 2x2 target tokens), `img_shapes` lists references
  then the target, and the prediction is the last target-length tokens. Text and references are modulated
  from t = 0 (`causal_condition`), so sampling caches their keys and values after the first step.
- Sampling: sigmas from the pipeline config's `sample_sigmas` (else linspace), true CFG without rescale.

Training follows from the sampling loop: x_t = (1 - σ)·x0 + σ·noise, the transformer gets σ (the loop's
t / 1000), and its prediction is regressed onto noise - x0 (the Euler step is x + (σ' - σ)·prediction).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from diffusers import QwenImage21Pipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import retrieve_timesteps
from tqdm.auto import tqdm

from qie.models.flow import noisy_latents, shift_mu, velocity_loss
from qie.types import Batch

_pack = QwenImage21Pipeline._pack_latents
_unpack = QwenImage21Pipeline._unpack_latents
# One image slot of the prompt stands for 2x2 latent tokens; one latent token is 16x16 pixels.
TOKENS_PER_SLOT = 4
VAE_SCALE = 16

# What differs from the Qwen-Image pipelines (see qie.models.DEFAULT_PIECES): the parts' classes, and images
# keep their alpha channel.
PART_CLASSES = {
    "vae": "diffusers:AutoencoderKLQwenImage21",
    "text_encoder": "transformers:Qwen3VLForConditionalGeneration",
    "processor": "qie.components.processor:Qwen3VLProcessorNoVideo",
    "transformer": "diffusers:QwenImage21Transformer2DModel",
}
ALPHA = True


class _NoProcessor:
    """Stands in for the processor when none is built (cached training, sampling from cached inputs): the
    pipeline's constructor reads its drop index from it; nothing else uses it then."""

    tokenizer = SimpleNamespace(encode=lambda text: [0])

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        return [[]]


def pipeline(parts: Any) -> QwenImage21Pipeline:
    """`QwenImage21Pipeline` over the built parts (a part not built stays None), with the checkpoint's
    `sample_sigmas` (its model_index.json, `parts.pipeline_config`) as `from_pretrained` would set them."""
    processor = parts.processor if parts.processor is not None else _NoProcessor()
    sigmas = getattr(parts, "pipeline_config", {}).get("sample_sigmas")
    return QwenImage21Pipeline(parts.scheduler, parts.vae, parts.text_encoder, processor, parts.transformer, sigmas)


@cache
def prompt_template() -> str:
    """The pipeline's two prompt templates as one string (part of prompt cache keys; the drop index follows
    from the processor, whose fingerprint is in the keys too)."""
    pipe = pipeline(SimpleNamespace(scheduler=None, vae=None, text_encoder=None, processor=None, transformer=None))
    return f"{pipe.prompt_template_t2i}|{pipe.prompt_template_ti2i}"


def default_size(spec: Any) -> tuple[int, int]:
    """(height, width) of a text-to-image output: the pipeline's `output_resolution` square, which is the
    side of the condition area (`model.vae_image_pixels`)."""
    side = math.isqrt(int(spec.vae_image_pixels))
    return side, side


def encode_prompt(
    pipe: QwenImage21Pipeline, prompt: str, images: Sequence[Any], device: torch.device
) -> dict[str, torch.Tensor]:
    """One prompt seen with its reference images (resized, RGBA or RGB), as the pipeline encodes it.

    Returns:
        {"embed": (tokens, dim), "image_mask": (tokens,) bool, True at the image slots}, unpadded, on the CPU.
    """
    embeds, _, image_mask = pipe.encode_prompt(prompt=[prompt], image=list(images) or None, device=device)
    return {"embed": embeds[0].cpu().clone(), "image_mask": image_mask[0].cpu().clone()}


def packed(latents: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(B, C, 1, h, w) -> (B, h*w, C) tokens and the (1, h, w) shape the transformer's rope uses."""
    b, c, _, h, w = latents.shape
    return _pack(latents, b, c, h, w), (1, h, w)


def with_target_slots(image_mask: torch.Tensor, target_tokens: int) -> torch.Tensor:
    """The transformer's `img_mask`: the prompt's image-pad mask, then one slot per 2x2 target tokens."""
    return torch.cat([image_mask, image_mask.new_ones(image_mask.shape[0], target_tokens // TOKENS_PER_SLOT)], dim=1)


def flow_matching_loss(
    transformer: torch.nn.Module,
    batch: Batch,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    weighting: str = "none",
) -> torch.Tensor:
    """Mean weighted squared error between the predicted and the true velocity (noise - x0).

    Args:
        transformer: QwenImage21Transformer2DModel (with or without LoRA), on the batch's device.
        batch: latents, references (`control_latents`), prompt embeddings and their image-pad mask.
        noise: like batch.latents.
        sigmas: (B,) noise levels in (0, 1], given to the transformer as its timestep.
    """
    if batch.prompt_image_mask is None:
        raise ValueError("a Qwen-Image-2.1 batch needs the prompt's image-pad mask (prompt_image_mask)")
    x0 = batch.latents
    noisy, target_shape = packed(noisy_latents(x0, noise, sigmas))
    references = [packed(c) for c in batch.control_latents]
    pred = transformer(
        hidden_states=torch.cat([tokens for tokens, _ in references] + [noisy], dim=1),
        timestep=sigmas.to(x0.device, x0.dtype),
        encoder_hidden_states=batch.prompt_embeds,
        encoder_hidden_states_mask=batch.prompt_embeds_mask,
        img_shapes=[[shape for _, shape in references] + [target_shape]] * x0.shape[0],
        img_mask=with_target_slots(batch.prompt_image_mask, noisy.shape[1]),
        return_dict=False,
    )[0][:, -noisy.shape[1] :]
    target, _ = packed(noise - x0)
    mask = None if batch.loss_mask is None else packed(batch.loss_mask.expand_as(x0))[0]
    return velocity_loss(pred, target, sigmas, weighting, mask)


def _prompt_inputs(pipe, embed, image_mask, copies: int, device) -> tuple:
    """The pipeline's `encode_prompt` over an already-encoded prompt: repeated per image, mask dropped."""
    return pipe.encode_prompt(
        prompt=None,
        device=device,
        num_images_per_prompt=copies,
        prompt_embeds=embed.unsqueeze(0).to(device),
        prompt_embeds_mask=None,
        image_pad_mask=image_mask.unsqueeze(0).to(device),
    )


def sample(
    parts: Any,
    prompt: tuple[torch.Tensor, torch.Tensor],
    negative: tuple[torch.Tensor, torch.Tensor] | None,
    references: Sequence[torch.Tensor],
    size: tuple[int, int],
    options: Any,
    progress: bool = False,
) -> torch.Tensor:
    """Latents of `options.num_images` images from one sample's encoded inputs (qie's sampler interface,
    see `qie.sampling.sample_edit`): `sample_latents` with the options' seed, CFG and steps."""
    multiple = 2 * VAE_SCALE
    height, width = (int(side) // multiple * multiple for side in size)
    return sample_latents(
        pipeline(parts),
        prompt,
        negative if options.guidance else None,
        references,
        height,
        width,
        torch.Generator("cpu").manual_seed(int(options.seed)),
        num_images=options.num_images,
        true_cfg_scale=options.true_cfg_scale,
        num_inference_steps=options.num_inference_steps,
        progress=progress,
    )


@torch.no_grad()
def sample_latents(
    pipe: QwenImage21Pipeline,
    prompt: tuple[torch.Tensor, torch.Tensor],
    negative: tuple[torch.Tensor, torch.Tensor] | None,
    references: Sequence[torch.Tensor],
    height: int,
    width: int,
    generator: torch.Generator | None,
    num_images: int = 1,
    true_cfg_scale: float = 1.0,
    num_inference_steps: int = 40,
    sigmas: Sequence[float] | None = None,
    use_kv_cache: bool = True,
    progress: bool = False,
) -> torch.Tensor:
    """Denoise from noise to the target's latents, step for step as `QwenImage21Pipeline.__call__`.

    Args:
        pipe: the pipeline over (at least) the transformer and the scheduler; its scheduler is not changed.
        prompt, negative: (embedding (tokens, dim), image-pad mask (tokens,)) as `encode_prompt` returns;
            CFG runs when `negative` is given and `true_cfg_scale` > 1.
        references: normalised reference latents, each (C, 1, h, w), in the prompt's image order.
        height, width: output size in pixels, multiples of 32.
        generator: draws the initial noise (B, 1, C, h, w), as the pipeline draws it.
        sigmas: sampling sigmas; None: the pipeline config's `sample_sigmas`, else `num_inference_steps`
            evenly spaced ones.

    Returns:
        Normalised latents (num_images, C, 1, height / 16, width / 16).
    """
    transformer, device = pipe.transformer, pipe.transformer.device
    embeds, mask, image_mask = _prompt_inputs(pipe, *prompt, num_images, device)
    do_cfg = negative is not None and true_cfg_scale > 1
    if do_cfg:
        neg_embeds, neg_mask, neg_image_mask = _prompt_inputs(pipe, *negative, num_images, device)
    channels = transformer.config.in_channels
    latents, _ = pipe.prepare_latents(None, num_images, channels, height, width, embeds.dtype, device, generator)
    refs = [r.unsqueeze(0).to(device, embeds.dtype).expand(num_images, -1, -1, -1, -1) for r in references]
    ref_tokens = torch.cat([packed(r)[0] for r in refs], dim=1) if refs else None
    f = pipe.vae_scale_factor
    img_shapes = [[packed(r)[1] for r in refs] + [(1, height // f, width // f)]]

    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    if sigmas is None:
        sigmas = pipe.config.sample_sigmas
        if sigmas is None:
            sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
    mu = shift_mu(latents.shape[1], scheduler.config)
    timesteps, _ = retrieve_timesteps(scheduler, None, device, sigmas=sigmas, mu=mu)
    image_mask = with_target_slots(image_mask, latents.shape[1])
    if do_cfg:
        neg_image_mask = with_target_slots(neg_image_mask, latents.shape[1])
    cached = use_kv_cache and transformer.config.causal_condition
    cond_cache = QwenImage21KVCache(len(transformer.transformer_blocks)) if cached else None
    neg_cache = QwenImage21KVCache(len(transformer.transformer_blocks)) if cached and do_cfg else None

    scheduler.set_begin_index(0)
    cond = (embeds, mask, image_mask, cond_cache, "cond")
    for i, t in enumerate(tqdm(timesteps, desc="denoise", disable=not progress)):
        kv_mode = ("extract" if i == 0 else "cached") if cached else None
        model_input = latents if ref_tokens is None else torch.cat([ref_tokens, latents], dim=1)
        timestep = t.expand(latents.shape[0]).to(latents.dtype) / 1000
        step = (transformer, model_input, timestep, img_shapes, kv_mode, latents.shape[1])
        pred = _predict(*step, *cond)
        if do_cfg:
            neg = _predict(*step, neg_embeds, neg_mask, neg_image_mask, neg_cache, "uncond")
            pred = neg + true_cfg_scale * (pred - neg)
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    return _unpack(latents, height, width, f)


def _predict(transformer, model_input, timestep, img_shapes, kv_mode, target_tokens, embeds, mask, image_mask,
             kv_cache, name) -> torch.Tensor:  # fmt: skip
    """One transformer call of the loop (named for diffusers' cache hooks); the target's tokens of its output."""
    with transformer.cache_context(name):
        out = transformer(
            hidden_states=model_input,
            timestep=timestep,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            img_shapes=img_shapes,
            img_mask=image_mask,
            attention_kwargs={},
            kv_cache=kv_cache,
            kv_cache_mode=kv_mode,
            return_dict=False,
        )[0]
    return out[:, -target_tokens:]


@torch.no_grad()
def decode_latents(vae: Any, latents: torch.Tensor, output_type: str = "pil") -> Any:
    """RGBA images from normalised latents (B, C, 1, h, w), as the pipeline decodes them."""
    latents = latents.to(vae.device, vae.dtype)
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
    std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
    images = vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
    processor = VaeImageProcessor(vae_scale_factor=VAE_SCALE, vae_latent_channels=vae.config.z_dim)
    return processor.postprocess(images, output_type=output_type)
