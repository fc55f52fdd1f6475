"""The Qwen-Image family: Qwen-Image-Edit, Edit-Plus (2509, 2511) and text-to-image Qwen-Image (2512).

Everything here follows diffusers 0.42.1's `QwenImageEditPipeline`, `QwenImageEditPlusPipeline` and
`QwenImagePipeline`, through their own helpers:
- Prompts: Qwen2.5-VL sees the prompt and the control image(s) (Edit: one, prompts batched; Edit-Plus: every image
  as "Picture N", one prompt per call; text-to-image: the text alone, cut at 512 tokens). The template's system
  prefix is dropped (the pipeline's drop index).
- Latents: the VAE's 16 channels, normalised with its latents_mean / latents_std, packed as 2x2 patches. The
  target's tokens come first, each control image's follow, `img_shapes` lists the target's shape then each
  control's, and the prediction is cut to the target's tokens.
- Training follows from the sampling loop: x_t = (1-σ)·x0 + σ·noise, the transformer gets σ as its timestep, and
  its prediction is regressed onto noise - x0 (`qie.models.flow`).
- Sampling (`qie.models.qwen_image_sampling`): sigmas linspace(1, 1/N), the scheduler's dynamic shift, true CFG
  rescaled to the conditional norm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import torch
from diffusers import QwenImageEditPipeline

from qie.models import pipeline_parts, real_size, text_positions
from qie.models.family import ModelFamily, PlannerFacts, Variant
from qie.models.flavour import Flavour, Tiny
from qie.models.flow import FlowPrediction, noisy_latents
from qie.models.outputs import IMAGES
from qie.models.qwen_image_sampling import QwenImageLoop, decode_latents, pack_latents, sample, vae_scale
from qie.types import Batch

VARIANTS = {
    "edit": Variant("QwenImageEditPipeline", "one", output_image=0, caption="edit_instruction"),
    "edit_plus": Variant("QwenImageEditPlusPipeline", "all", output_image=-1, caption="edit_instruction"),
    "text_to_image": Variant("QwenImagePipeline", "none", output_image=None, caption="describe", max_prompt_tokens=512),
}


# --- parts and prompts ----------------------------------------------------------------------------------


def pipeline(spec: Any, parts: Any) -> Any:
    """The variant's diffusers pipeline over the built parts (parts not built stay None)."""
    return spec.pipeline_cls()(**{name: getattr(parts, name, None) for name in spec.part_names})


@cache
def _pipeline_facts(pipeline_class: str) -> tuple[str, int, int]:
    """(prompt template, drop index, default sample size) of a component-less pipeline instance."""
    import diffusers

    cls = getattr(diffusers, pipeline_class)
    pipe = cls(**{name: None for name in pipeline_parts(pipeline_class)})
    return pipe.prompt_template_encode, int(pipe.prompt_template_encode_start_idx), int(pipe.default_sample_size)


def prompt_template(spec: Any) -> str:
    """The pipeline's prompt template, drop index and prompt cut, as one string (part of prompt keys)."""
    template, drop_idx, _ = _pipeline_facts(spec.pipeline_class)
    cut = f"|{spec.pipe.max_prompt_tokens}" if spec.pipe.max_prompt_tokens else ""
    return f"{template}|{drop_idx}{cut}"


def default_size(spec: Any, vae_scale: int) -> tuple[int, int]:
    """The pipeline's default sample size (in latents) times the VAE's scale."""
    side = _pipeline_facts(spec.pipeline_class)[2] * vae_scale
    return side, side


def encode_prompts(
    pipeline: Any, spec: Any, prompts: Sequence[str], images: Sequence[Sequence[Any]], device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """Prompts seen with their control images, each {"embed": (tokens, dim)} without padding, on the CPU.

    Prompts without images (text-to-image, or an Edit-Plus sample without a control image: the pipeline's
    text-only prompt) and Edit prompts (one image each) are encoded in batches; Edit-Plus prompts with images one
    at a time, as diffusers' multi-image prompt applies one image list to every prompt of a call.
    """
    if spec.pipe.prompt_images == "one":
        embeds = _encode(pipeline, spec, list(prompts), [imgs[0] for imgs in images], device)
        return [{"embed": e} for e in embeds]
    out: list[torch.Tensor | None] = [None] * len(prompts)
    text_only = [i for i, imgs in enumerate(images) if not imgs]
    if text_only:
        for i, embed in zip(text_only, _encode(pipeline, spec, [prompts[i] for i in text_only], None, device)):
            out[i] = embed
    for i in (i for i, imgs in enumerate(images) if imgs):
        (out[i],) = _encode(pipeline, spec, [prompts[i]], list(images[i]), device)
    return [{"embed": embed} for embed in out]


def _encode(pipeline: Any, spec: Any, prompts: list[str], images: list | None, device) -> list[torch.Tensor]:
    # The text-to-image pipeline takes no `image`; an Edit-Plus prompt without one is its text-only prompt.
    kwargs = {} if images is None else {"image": images}
    embeds, mask = pipeline._get_qwen_prompt_embeds(prompt=prompts, device=device, **kwargs)
    cut = spec.pipe.max_prompt_tokens  # where the pipeline's __call__ cuts prompt embeddings
    return [e[: min(int(n), cut or int(n))].cpu().clone() for e, n in zip(embeds, mask.sum(dim=1).tolist())]


def encode_latents(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    """Normalised latents (B, C, 1, h, w) of pixels (B, 3, 1, H, W) in [-1, 1], as the Edit pipelines encode them."""
    encoder = QwenImageEditPipeline(
        scheduler=None, vae=vae, text_encoder=None, tokenizer=None, processor=None, transformer=None
    )
    return encoder._encode_vae_image(pixels.to(vae.device, vae.dtype), generator=None)


# --- training -------------------------------------------------------------------------------------------


def packed(latents: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """(B, C, 1, h, w) -> (B, h/2 * w/2, 4C) tokens, and the frame's (1, h/2, w/2) shape the rotary embedding uses."""
    b, c, _, h, w = latents.shape
    return pack_latents(latents[:, :, 0], b, c, h, w), [(1, h // 2, w // 2)]


def packed_prediction(
    transformer: torch.nn.Module,
    batch: Batch,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    pack: Callable[[torch.Tensor], tuple[torch.Tensor, list[tuple[int, int, int]]]],
    **conditions: Any,
) -> FlowPrediction:
    """The predicted and the true velocity (noise - x0) of the noisy batch, for a transformer that reads the noisy
    target's tokens, then the controls', as one sequence.

    Args:
        pack: (B, C, F, h, w) latents -> (tokens, one rotary-embedding shape per frame).
        conditions: further transformer inputs (a Layered transformer's `additional_t_cond`).
    """
    x0 = batch.latents
    noisy, frames = pack(noisy_latents(x0, noise, sigmas))
    controls = [pack(c) for c in batch.control_latents]
    shapes = frames + [s for _, shapes in controls for s in shapes]
    text_positions.check_batch(batch, text_positions.qwen_image(shapes, layered=len(frames) > 1))
    pred = transformer(
        hidden_states=torch.cat([noisy] + [tokens for tokens, _ in controls], dim=1),
        timestep=sigmas.to(x0.device, x0.dtype),
        encoder_hidden_states=batch.prompt_embeds,
        encoder_hidden_states_mask=batch.prompt_embeds_mask,
        img_shapes=[shapes] * x0.shape[0],
        return_dict=False,
        **conditions,
    )[0][:, : noisy.shape[1]]
    target, _ = pack(noise - x0)
    mask = None if batch.loss_mask is None else pack(batch.loss_mask.expand_as(x0))[0]
    return FlowPrediction(pred, target, sigmas, mask)


def flow_prediction(
    transformer: torch.nn.Module, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor
) -> FlowPrediction:
    """The predicted and the true velocity (noise - x0) of the batch noised to `sigmas`.

    Args:
        transformer: QwenImageTransformer2DModel (with or without LoRA), on the batch's device.
        batch: latents and prompt embeddings, on the transformer's device.
        noise: like batch.latents.
        sigmas: (B,) noise levels in (0, 1]; the transformer is given σ as its timestep.
    """
    return packed_prediction(transformer, batch, noise, sigmas, packed)


# --- rules and planner facts ----------------------------------------------------------------------------


def config_problems(spec: Any) -> list[str]:
    """Nothing in a Qwen-Image model config can contradict the pipelines: sizes are free."""
    return []


def checkpoint_problems(spec: Any, read_json: Any) -> list[str]:
    """The start-up check's facts (`ModelSpec.mismatches`) cover what these pipelines need of a checkpoint."""
    return []


def sampling_notes(spec: Any, pipeline_config: dict, options: Any) -> list[str]:
    """The pipelines sample exactly the options' steps and scale: nothing to warn of."""
    return []


def step_inputs(config: dict, work: Any, make: Any = torch.empty) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """(batch, noise, sigmas) of the planner's `work` for a transformer of `config`; `make(*shape, dtype=)` makes
    each tensor. Latents are squares of the token counts: the step's memory depends on the counts only."""

    def latents(tokens: int) -> torch.Tensor:
        side = round(tokens**0.5)
        return make(work.batch, config["out_channels"], 1, 2 * side, 2 * side, dtype=work.dtype)

    batch = Batch(
        ids=["x"] * work.batch,
        latents=latents(work.target_tokens),
        control_latents=[latents(t) for t in work.control_tokens],
        prompt_embeds=make(work.batch, work.prompt_tokens, config["joint_attention_dim"], dtype=work.dtype),
        prompt_embeds_mask=None,
    )
    return batch, latents(work.target_tokens), torch.full((work.batch,), 0.5)


# --- flavours: the published size and the tiny presets -------------------------------------------------

# Qwen-Image's scheduler/scheduler_config.json.
SCHEDULER_CONFIG: dict[str, Any] = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
# Where each part comes from, as model_index.json names it; a pipeline lists the parts it takes.
MODEL_INDEX: dict[str, tuple[str, str]] = {
    "processor": ("transformers", "Qwen2VLProcessor"),
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "transformer": ("diffusers", "QwenImageTransformer2DModel"),
    "vae": ("diffusers", "AutoencoderKLQwenImage"),
}
TINY_TRANSFORMER: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 3,
    "joint_attention_dim": 16,
    "guidance_embeds": False,
    "axes_dims_rope": (8, 4, 4),
}
TINY_TEXT_HIDDEN = 16  # == the tiny transformer's joint_attention_dim
# Fixed, deliberately non-trivial latent statistics so normalisation bugs change results.
TINY_VAE: dict[str, Any] = {
    "base_dim": 24,
    "z_dim": 4,
    "dim_mult": [1, 2, 4],
    "num_res_blocks": 1,
    "temperal_downsample": [False, True],
    "latents_mean": [-0.35, 0.2, 0.45, -0.1],
    "latents_std": [0.6, 1.35, 0.85, 1.2],
}
TINY_TEXT_ENCODER: dict[str, Any] = {
    "text_config": {
        "hidden_size": TINY_TEXT_HIDDEN,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        # head_dim 8 -> 4 rotary frequencies, split over (temporal, height, width)
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
    },
    "vision_config": {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": TINY_TEXT_HIDDEN,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
    },
}
# Qwen's CLIP normalisation; pixel bounds sized for 64 px test images (56x56 -> 4 image tokens).
TINY_PROCESSOR: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "min_pixels": 56 * 56,
    "max_pixels": 128 * 128,
    "merge_size": 2,
    "patch_size": 14,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "temporal_patch_size": 2,
}
EDIT_PIPELINES = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
TINY = Flavour(
    TINY_TRANSFORMER,
    TINY_VAE,
    TINY_TEXT_ENCODER,
    Tiny(
        pipeline="QwenImageEditPipeline",
        tokenizer="qie.models.tiny_tokenizer:build_tokenizer",
        tokenizer_pipelines=EDIT_PIPELINES,
        text_tokens={"bos_token_id": "pad_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "pad_token_id"},
        scheduler=SCHEDULER_CONFIG,
        model_index=MODEL_INDEX,
        processor=TINY_PROCESSOR,
        video_processor=True,
    ),
)
# The demo's Edit model: a larger transformer and a VAE trained on the demo's shapes, shipped with qie
# (written by scripts/train_demo_vae.py; images only, one frame, so no temporal downsampling).
DEMO_VAE: dict[str, Any] = {
    "base_dim": 16,
    "z_dim": 8,
    "dim_mult": [1, 2, 2],
    "num_res_blocks": 1,
    "temperal_downsample": [False, False],
}
DEMO_TRANSFORMER: dict[str, Any] = {
    "in_channels": 4 * 8,
    "out_channels": 8,
    "num_layers": 4,
    "attention_head_dim": 32,
    "num_attention_heads": 4,
    "axes_dims_rope": (8, 12, 12),
}
FLAVOURS = {
    # Qwen-Image(-Edit, -Edit-2509/2511, -2512): 20 B transformer, Qwen2.5-VL-7B.
    "published": Flavour(real_size.TRANSFORMER, real_size.VAE, real_size.TEXT_ENCODER),
    "edit": TINY,
    "edit_plus": TINY.but(pipeline="QwenImageEditPlusPipeline"),
    # The Edit-Plus weights (same seed), with control tokens at timestep 0 as in Qwen-Image-Edit-2511.
    "edit_2511": TINY.but(transformer={"zero_cond_t": True}, pipeline="QwenImageEditPlusPipeline"),
    "t2i": TINY.but(pipeline="QwenImagePipeline", tokenizer_pipelines=("QwenImagePipeline",)),
    "demo": TINY.but(transformer=DEMO_TRANSFORMER, vae=DEMO_VAE, vae_weights="tiny_demo_vae.safetensors"),
}

FAMILY = ModelFamily(
    name="qwen_image",
    variants=VARIANTS,
    part_classes={
        "vae": "diffusers:AutoencoderKLQwenImage",
        "text_encoder": "transformers:Qwen2_5_VLForConditionalGeneration",
        "tokenizer": "transformers:Qwen2Tokenizer",
        "processor": "qie.models.processor:QwenImageProcessorNoVideo",
        "transformer": "diffusers:QwenImageTransformer2DModel",
        "scheduler": "diffusers:FlowMatchEulerDiscreteScheduler",
    },
    alpha=False,
    patch_size=2,
    blocks="transformer_blocks",
    # The last joint block's text queries and text outputs: only text outputs depend on them, and the
    # transformer returns image tokens alone.
    unused_in_last_block=("attn.add_q_proj", "attn.norm_added_q", "attn.to_add_out", "txt_mlp"),
    lora_loader="diffusers.loaders:QwenImageLoraLoaderMixin",
    # Input and output projections stay in full precision: they are small and quantizing them costs quality.
    keep_full_precision=("img_in", "txt_in*", "proj_out", "norm_out*", "time_text_embed*"),
    # A dual-stream block's text MLP and the text input's norm: 2.1's blocks are single-stream.
    weight_signature=("txt_norm.weight", "transformer_blocks.0.txt_mlp.net.0.proj.weight"),
    flavours=FLAVOURS,
    # 8x VAE, 2x2 patches; Qwen2.5-VL sees 28x28-pixel tokens (14 px patches merged 2x2); the template adds ~64.
    planner=PlannerFacts(16, 28 * 28, 64, "Qwen2.5-VL-7B", step_inputs),
    outputs=IMAGES,
    pipeline=pipeline,
    prompt_template=prompt_template,
    default_size=default_size,
    encode_prompts=encode_prompts,
    encode_latents=encode_latents,
    predict=flow_prediction,
    sample=sample,
    denoise=QwenImageLoop.denoise,
    decode=decode_latents,
    vae_scale=vae_scale,
    config_problems=config_problems,
    checkpoint_problems=checkpoint_problems,
    sampling_notes=sampling_notes,
    text_positions=lambda spec, frames: text_positions.qwen_image(frames),
)
