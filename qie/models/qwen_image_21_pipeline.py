"""Qwen-Image-2.1's pipeline pieces: the pipeline object, the latents' packing, its denoising loop over
already-encoded inputs, and decoding.

Sigmas come from the pipeline config's `sample_sigmas` (else linspace); true CFG runs without rescale; reference
tokens fill the prompt's image slots and the target's tokens are appended; text and references are modulated from
t = 0, so their keys and values are cached after the first step. `qie.models.qwen_image_21` holds the family's other
pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from diffusers import QwenImage21Pipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

from qie.models.flow import predict
from qie.models.flow_family import FlowLoop
from qie.models.sampling import Prediction, PromptInputs, initial_noise

_pack = QwenImage21Pipeline._pack_latents
_unpack = QwenImage21Pipeline._unpack_latents
# One image slot of the prompt stands for 2x2 latent tokens; one latent token is 16x16 pixels.
TOKENS_PER_SLOT = 4
VAE_SCALE = 16


class _NoProcessor:
    """Stands in for the processor when none is built (cached training or sampling): it gives the drop index."""

    tokenizer = SimpleNamespace(encode=lambda text: [0])

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        return [[]]


def pipeline(spec: Any, parts: Any) -> QwenImage21Pipeline:
    """`QwenImage21Pipeline` over the built parts (a part not built stays None), with the checkpoint's
    `sample_sigmas` (its model_index.json, `parts.pipeline_config`) as `from_pretrained` would set them."""
    processor = parts.processor if parts.processor is not None else _NoProcessor()
    sigmas = getattr(parts, "pipeline_config", {}).get("sample_sigmas")
    return QwenImage21Pipeline(parts.scheduler, parts.vae, parts.text_encoder, processor, parts.transformer, sigmas)


def packed(latents: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(B, C, 1, h, w) -> (B, h*w, C) tokens and the (1, h, w) shape the transformer's rope uses."""
    b, c, _, h, w = latents.shape
    return _pack(latents, b, c, h, w), (1, h, w)


def with_target_slots(image_mask: torch.Tensor, target_tokens: int) -> torch.Tensor:
    """The transformer's `img_mask`: the prompt's image-pad mask, then one slot per 2x2 target tokens."""
    return torch.cat([image_mask, image_mask.new_ones(image_mask.shape[0], target_tokens // TOKENS_PER_SLOT)], dim=1)


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
    controls: Sequence[torch.Tensor],
    size: tuple[int, int],
    options: Any,
    progress: bool = False,
) -> torch.Tensor:
    """Latents of `options.num_images` images from one sample's encoded inputs (qie's sampler interface,
    see `qie.models.family`): `sample_latents` with the options' seed, CFG and steps."""
    multiple = 2 * VAE_SCALE
    height, width = (int(side) // multiple * multiple for side in size)
    return sample_latents(
        pipeline(None, parts),
        prompt,
        negative=negative if options.guidance else None,
        references=controls,
        height=height,
        width=width,
        generator=torch.Generator("cpu").manual_seed(int(options.seed)),
        num_images=options.num_images,
        true_cfg_scale=options.true_cfg_scale if options.guidance else 1.0,
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
    neg = None
    if negative is not None and true_cfg_scale > 1:
        neg = PromptInputs(*_prompt_inputs(pipe, *negative, num_images, device))
    f = pipe.vae_scale_factor
    shape = (num_images, transformer.config.in_channels, 1, 2 * (height // (f * 2)), 2 * (width // (f * 2)))
    noise = initial_noise(shape, generator, device, embeds.dtype)
    refs = [r.unsqueeze(0) for r in references]
    config = {"sample_sigmas": pipe.config.sample_sigmas}
    loop = QwenImage21Loop if use_kv_cache else UncachedQwenImage21Loop
    return loop.denoise(
        transformer,
        pipe.scheduler,
        noise,
        prompt=PromptInputs(embeds, mask, image_mask),
        negative=neg,
        controls=refs,
        steps=num_inference_steps,
        true_cfg_scale=true_cfg_scale,
        pipeline_config=config,
        sigmas=sigmas,
        progress=progress,
    )


class QwenImage21Loop(FlowLoop):
    """The pipeline's denoising run (`FlowLoop.denoise` is the family's `denoise`): reference tokens, then the
    target's; the checkpoint's `sample_sigmas` where set; true CFG without rescale; with a causal-condition
    transformer, each branch's text and reference keys and values extracted by its first transformer call and reused
    after (a replay that calls the transformer at a few steps alone extracts them at the first of those)."""

    sigma_schedule = "linspace_to_1_over_n"  # where the checkpoint has no `sample_sigmas`
    reads_sample_sigmas = True
    use_kv_cache = True

    def __init__(self, transformer: Any, noise: torch.Tensor, controls: Sequence[torch.Tensor]) -> None:
        batch, _, _, lat_h, lat_w = noise.shape
        self.transformer, self.size = transformer, (lat_h, lat_w)
        self.latents = packed(noise)[0]
        refs = [r.to(noise.device, noise.dtype).expand(batch, -1, -1, -1, -1) for r in controls]
        self.ref_tokens = torch.cat([packed(r)[0] for r in refs], dim=1) if refs else None
        self.img_shapes = [[packed(r)[1] for r in refs] + [(1, lat_h, lat_w)]]
        self.cached = self.use_kv_cache and transformer.config.causal_condition

    def prediction(self, inputs: PromptInputs, name: str) -> Prediction:
        image_mask = with_target_slots(inputs.image_mask, self.latents.shape[1])
        kv_cache = QwenImage21KVCache(len(self.transformer.transformer_blocks)) if self.cached else None
        extracting: list[int] = []  # the step whose call filled the cache

        def call(i: int, t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
            # The condition's keys and values do not depend on the step (it sits at t = 0): the first call that runs
            # the transformer (a replay skips some) extracts them, and so does its recomputation under gradient
            # checkpointing (which must save the same tensors); every other call reads them.
            kv_mode = ("extract" if i in (extracting or [i]) else "cached") if self.cached else None
            model_input = latents if self.ref_tokens is None else torch.cat([self.ref_tokens, latents], dim=1)
            timestep = t.expand(latents.shape[0]).to(latents.dtype) / 1000
            out = _predict(
                self.transformer,
                model_input,
                timestep=timestep,
                img_shapes=self.img_shapes,
                kv_mode=kv_mode,
                target_tokens=latents.shape[1],
                embeds=inputs.embeds,
                mask=inputs.mask,
                image_mask=image_mask,
                kv_cache=kv_cache,
                name=name,
            )
            if self.cached and not extracting and kv_cache.layer_caches[0].k is not None:
                extracting.append(i)
            return out

        return call

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        return _unpack(latents, *self.size, 1)


class UncachedQwenImage21Loop(QwenImage21Loop):
    """The loop recomputing the text and reference tokens at every step (the pipeline's `use_kv_cache=False`)."""

    use_kv_cache = False


def _predict(
    transformer, model_input, timestep, img_shapes, kv_mode, target_tokens, embeds, mask, image_mask, kv_cache, name
) -> torch.Tensor:
    """One transformer call of the loop (named for diffusers' cache hooks); the target's tokens of its output."""
    out = predict(
        transformer,
        name,
        hidden_states=model_input,
        timestep=timestep,
        encoder_hidden_states=embeds,
        encoder_hidden_states_mask=mask,
        img_shapes=img_shapes,
        img_mask=image_mask,
        attention_kwargs={},
        kv_cache=kv_cache,
        kv_cache_mode=kv_mode,
    )
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
