"""Qwen-Image-2.1: text-to-image and editing with up to 10 reference images, through `QwenImage21Pipeline`.

What differs from Qwen-Image-Edit, all read from diffusers 0.42.1's pipeline and transformer:
- Prompts: Qwen3-VL sees the prompt and every reference image (RGBA composited on white for it only); the
  pipeline's `encode_prompt` returns the embeddings and an image-pad mask (which positions are image slots).
- Latents: 64 channels from an RGBA VAE (16x down), unpatched: one token per latent pixel, one prompt slot per 2x2.
- Transformer: one joint sequence; reference tokens fill the prompt's image slots, the target's tokens are
  appended (`img_mask` = image-pad mask + one slot per 2x2 target tokens), `img_shapes` lists references
  then the target, and the prediction is the last target-length tokens. Text and references are modulated
  from t = 0 (`causal_condition`), so sampling caches their keys and values after the first step.
- Sampling: sigmas from the pipeline config's `sample_sigmas` (else linspace), true CFG without rescale.

Training follows from the sampling loop: x_t = (1 - σ)·x0 + σ·noise, the transformer gets σ (the loop's t / 1000),
and its prediction is regressed onto noise - x0 (the Euler step is x + (σ' - σ)·prediction).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache
from types import SimpleNamespace
from typing import Any

import torch
from diffusers import QwenImage21Pipeline

from qie.models import qwen_image, real_size, text_positions
from qie.models.family import ModelFamily, PlannerFacts, Variant
from qie.models.flavour import Flavour, Tiny
from qie.models.flow import FlowPrediction, noisy_latents
from qie.models.outputs import IMAGES
from qie.models.qwen_image_21_pipeline import (
    TOKENS_PER_SLOT,
    VAE_SCALE,
    QwenImage21Loop,
    decode_latents,
    packed,
    pipeline,
    sample,
    with_target_slots,
)
from qie.types import Batch

VARIANTS = {"qwen_image_21": Variant("QwenImage21Pipeline", "all", output_image=-1, caption="edit_instruction")}


def prompt_template(spec: Any) -> str:
    """The pipeline's two prompt templates as one string (part of prompt cache keys; the drop index follows
    from the processor, whose fingerprint is in the keys too)."""
    return _prompt_templates()


@cache
def _prompt_templates() -> str:
    parts = SimpleNamespace(scheduler=None, vae=None, text_encoder=None, processor=None, transformer=None)
    pipe = pipeline(None, parts)
    return f"{pipe.prompt_template_t2i}|{pipe.prompt_template_ti2i}"


def default_size(spec: Any, vae_scale: int) -> tuple[int, int]:
    """(height, width) of a text-to-image output: the pipeline's `output_resolution` square, which is the
    side of the condition area (`model.vae_image_pixels`)."""
    side = math.isqrt(int(spec.vae_image_pixels))
    return side, side


def encode_prompts(
    pipeline: QwenImage21Pipeline, spec: Any, prompts: Sequence[str], images: Sequence[Sequence[Any]], device
) -> list[dict[str, torch.Tensor]]:
    """Each prompt seen with its reference images (resized, RGBA or RGB), as the pipeline encodes it, one prompt
    per call (prompts of different lengths batched together would move the rope positions).

    Returns:
        One {"embed": (tokens, dim), "image_mask": (tokens,) bool, True at the image slots} per prompt,
        unpadded, on the CPU.
    """
    out = []
    for prompt, imgs in zip(prompts, images):
        embeds, _, image_mask = pipeline.encode_prompt(prompt=[prompt], image=list(imgs) or None, device=device)
        out.append({"embed": embeds[0].cpu().clone(), "image_mask": image_mask[0].cpu().clone()})
    return out


def encode_latents(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    """Normalised latents (B, 64, 1, h, w) of RGBA pixels (B, 4, 1, H, W) in [-1, 1], as the pipeline encodes."""
    parts = SimpleNamespace(scheduler=None, vae=vae, text_encoder=None, processor=None, transformer=None)
    return pipeline(None, parts)._encode_vae_image(pixels.to(vae.device, vae.dtype), generator=None)


def vae_scale(vae: Any) -> int:
    """Pixels per latent along a side: 16 (the pipeline's own constant)."""
    return VAE_SCALE


def flow_prediction(
    transformer: torch.nn.Module, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor
) -> FlowPrediction:
    """The predicted and the true velocity (noise - x0) of the batch noised to `sigmas`.

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
    text_positions.check_batch(batch, text_positions.qwen_image_21([s for _, s in references] + [target_shape]))
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
    return FlowPrediction(pred, target, sigmas, mask)


# --- rules and planner facts ----------------------------------------------------------------------------


def config_problems(spec: Any) -> list[str]:
    """The pipeline resizes a reference once, to its `output_resolution`², for Qwen3-VL and the VAE alike: one
    vision token then covers the 2x2 latent tokens of its image slot. Different areas cannot line up."""
    if spec.vl_image_pixels != spec.vae_image_pixels:
        return [
            f"model.vl_image_pixels={spec.vl_image_pixels} and model.vae_image_pixels={spec.vae_image_pixels} differ, "
            f"but model={spec.name} (Qwen-Image-2.1) resizes each reference once for Qwen3-VL and the VAE: set both "
            "to the same area (the pipeline's output_resolution², e.g. 1048576)"
        ]
    return []


def checkpoint_problems(spec: Any, read_json: Any) -> list[str]:
    """A processor that would resize the (already resized) references again gives image slots that do not match
    the latent tokens, a shape error deep in the transformer after both encoders ran: refuse it up front."""
    config = read_json("processor/preprocessor_config.json")
    limit = config.get("max_pixels") or (config.get("size") or {}).get("longest_edge")
    if limit is not None and int(limit) < spec.vae_image_pixels:
        return [
            f"its processor resizes images above max_pixels={limit} pixels, below the condition area "
            f"model.vae_image_pixels={spec.vae_image_pixels}: the references would be resized twice and no longer "
            "match their latents; raise max_pixels in processor/preprocessor_config.json or lower "
            "model.vae_image_pixels and model.vl_image_pixels"
        ]
    return []


def sampling_notes(spec: Any, pipeline_config: dict, options: Any) -> list[str]:
    """The checkpoint's `sample_sigmas` fix the steps the pipeline takes: a step count asked for is not used."""
    sigmas = pipeline_config.get("sample_sigmas")
    steps = getattr(options, "num_inference_steps", None)
    if sigmas and steps is not None and int(steps) != len(sigmas):
        return [
            f"num_inference_steps={steps} is not used: the checkpoint's model_index.json fixes {len(sigmas)} "
            "sampling steps (sample_sigmas), as QwenImage21Pipeline samples them"
        ]
    return []


def step_inputs(config: dict, work: Any, make: Any = torch.empty) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """(batch, noise, sigmas) of the planner's `work` (token counts of 16x latents, one token per latent pixel)
    for a transformer of `config`: references fill the prompt's first image slots, one slot per 2x2 tokens."""

    def latents(tokens: int) -> torch.Tensor:
        side = 2 * round((tokens / 4) ** 0.5)
        return make(work.batch, config["out_channels"], 1, side, side, dtype=work.dtype)

    controls = [latents(t) for t in work.control_tokens]
    slots = sum(c.shape[-1] * c.shape[-2] for c in controls) // TOKENS_PER_SLOT
    length = max(work.prompt_tokens, slots + 1)
    image_mask = torch.zeros(work.batch, length, dtype=torch.bool)
    image_mask[:, :slots] = True
    batch = Batch(
        ids=["x"] * work.batch,
        latents=latents(work.target_tokens),
        control_latents=controls,
        prompt_embeds=make(work.batch, length, config["context_in_dim"], dtype=work.dtype),
        prompt_embeds_mask=None,
        prompt_image_mask=image_mask,
    )
    return batch, latents(work.target_tokens), torch.full((work.batch,), 0.5)


# --- flavours: the published size and the tiny preset --------------------------------------------------

TINY_TEXT_HIDDEN = 16  # == the tiny transformer's context_in_dim
TINY_TRANSFORMER: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": 64,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "context_in_dim": TINY_TEXT_HIDDEN,
    "mlp_ratio": 3,
    "axes_dims_rope": (8, 4, 4),
    "causal_condition": True,
}
# 16x down (five levels, four downsamples) as the pipeline assumes; z_dim 64 keeps the real latent statistics.
TINY_VAE: dict[str, Any] = {
    "base_dim": 8,
    "decoder_base_dim": 12,
    "z_dim": 64,
    "dim_mult": [1, 2, 2, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True, True],
    "in_channels": 4,
    "out_channels": 4,
}
# A two-layer Qwen3-VL: text head_dim 8 (mrope sections sum to 4), vision patch 16 with a 2x2 merge.
TINY_TEXT_ENCODER: dict[str, Any] = {
    "text_config": {
        "hidden_size": TINY_TEXT_HIDDEN,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    },
    "vision_config": {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": TINY_TEXT_HIDDEN,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
    },
}
# Qwen3-VL's image processor: 16 px patches, 2x2 merge, [-1, 1] normalisation. The pipeline resizes first,
# so the processor must not resize again: max_pixels above any condition area.
TINY_PROCESSOR: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen3VLProcessor",
    "min_pixels": 32 * 32,
    "max_pixels": 4096 * 4096,
    "merge_size": 2,
    "patch_size": 16,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "temporal_patch_size": 2,
}
FLAVOURS = {
    # Qwen-Image-2.1: diffusers 0.42.1's default transformer and VAE, Qwen3-VL-8B.
    "published": Flavour(real_size.TRANSFORMER_21, real_size.VAE_21, real_size.TEXT_ENCODER_21),
    # The tokenizer is trained on 2.1's templates (written out in `qie.models.tiny_tokenizer`); four steps of the
    # pipeline's default-sigma path (`sample_sigmas` in model_index.json).
    "qwen_image_21": Flavour(
        TINY_TRANSFORMER,
        TINY_VAE,
        TINY_TEXT_ENCODER,
        Tiny(
            pipeline="QwenImage21Pipeline",
            tokenizer="qie.models.tiny_tokenizer:build_tokenizer_21",
            tokenizer_pipelines=(),
            text_tokens={"pad_token_id": "pad_token_id"},
            scheduler=qwen_image.SCHEDULER_CONFIG,
            model_index={
                "processor": ("transformers", "Qwen3VLProcessor"),
                "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
                "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
                "transformer": ("diffusers", "QwenImage21Transformer2DModel"),
                "vae": ("diffusers", "AutoencoderKLQwenImage21"),
            },
            processor=TINY_PROCESSOR,
            index_extra={"sample_sigmas": [1.0, 0.8, 0.55, 0.3]},
        ),
    ),
}

FAMILY = ModelFamily(
    name="qwen_image_21",
    variants=VARIANTS,
    part_classes={
        "vae": "diffusers:AutoencoderKLQwenImage21",
        "text_encoder": "transformers:Qwen3VLForConditionalGeneration",
        "tokenizer": "transformers:Qwen2Tokenizer",
        "processor": "qie.models.processor:Qwen3VLProcessorNoVideo",
        "transformer": "diffusers:QwenImage21Transformer2DModel",
        "scheduler": "diffusers:FlowMatchEulerDiscreteScheduler",
    },
    alpha=True,
    patch_size=1,
    blocks="transformer_blocks",
    unused_in_last_block=(),  # single-stream blocks: every layer serves the image tokens too
    lora_loader="diffusers.loaders:QwenImageLoraLoaderMixin",
    # The input, text and output projections and the timestep embedding stay in full precision: small, and
    # quantizing them costs quality.
    keep_full_precision=("img_in", "txt_in*", "proj_out", "norm_out*", "time_text_embed*"),
    # The text input's own norm (what diffusers' single-file loader recognises 2.1 by).
    weight_signature=("txt_in.text_norm.weight",),
    flavours=FLAVOURS,
    # 16x VAE, one token per latent pixel; Qwen3-VL sees 32x32-pixel tokens (16 px patches merged 2x2).
    planner=PlannerFacts(16, 32 * 32, 32, "Qwen3-VL-8B", step_inputs),
    outputs=IMAGES,
    pipeline=pipeline,
    prompt_template=prompt_template,
    default_size=default_size,
    encode_prompts=encode_prompts,
    encode_latents=encode_latents,
    predict=flow_prediction,
    sample=sample,
    denoise=QwenImage21Loop.denoise,
    decode=decode_latents,
    vae_scale=vae_scale,
    config_problems=config_problems,
    checkpoint_problems=checkpoint_problems,
    sampling_notes=sampling_notes,
    text_positions=lambda spec, frames: text_positions.qwen_image_21(frames),
)
