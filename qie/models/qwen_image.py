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
- Sampling: sigmas linspace(1, 1/N), the scheduler's dynamic shift, true CFG rescaled to the conditional norm.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

import numpy as np
import torch
from diffusers import QwenImageEditPipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import retrieve_timesteps

from qie.models import pipeline_parts, real_size, text_positions
from qie.models.family import ModelFamily, PlannerFacts, Variant
from qie.models.flow import noisy_latents, predict, shift_mu, velocity_loss
from qie.sampling import Prediction, PromptInputs, SamplingOptions, denoise, initial_noise, true_cfg_enabled
from qie.types import Batch, pad_prompt_embeds

pack_latents = QwenImageEditPipeline._pack_latents
_unpack_latents = QwenImageEditPipeline._unpack_latents

VARIANTS = {
    "edit": Variant("QwenImageEditPipeline", "one", output_image=0, caption="edit_instruction"),
    "edit_plus": Variant("QwenImageEditPlusPipeline", "all", output_image=-1, caption="edit_instruction"),
    "text_to_image": Variant("QwenImagePipeline", "none", output_image=None, caption="describe",
                                  max_prompt_tokens=512),
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


def vae_scale(vae: Any) -> int:
    """Pixels per latent along a side (8 for Qwen-Image's VAE), computed as the pipelines do."""
    return 2 ** len(vae.temperal_downsample)


# --- training -------------------------------------------------------------------------------------------


def packed(latents: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """(B, C, 1, h, w) -> (B, h/2 * w/2, 4C) tokens, and the frame's (1, h/2, w/2) shape the rotary embedding uses."""
    b, c, _, h, w = latents.shape
    return pack_latents(latents[:, :, 0], b, c, h, w), [(1, h // 2, w // 2)]


def packed_loss(
    transformer: torch.nn.Module,
    batch: Batch,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    weighting: str,
    pack: Callable[[torch.Tensor], tuple[torch.Tensor, list[tuple[int, int, int]]]],
    per_sample: bool = False,
    **conditions: Any,
) -> torch.Tensor:
    """Mean weighted squared error between the predicted and the true velocity (noise - x0), for a transformer
    that reads the noisy target's tokens, then the controls', as one sequence.

    Args:
        pack: (B, C, F, h, w) latents -> (tokens, one rotary-embedding shape per frame).
        per_sample: each sample's loss (B,) instead of their mean.
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
    return velocity_loss(pred, target, sigmas, weighting, mask, per_sample)


def flow_matching_loss(
    transformer: torch.nn.Module,
    batch: Batch,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    weighting: str = "none",
    per_sample: bool = False,
) -> torch.Tensor:
    """Mean weighted squared error between the predicted and the true velocity (noise - x0).

    Args:
        transformer: QwenImageTransformer2DModel (with or without LoRA), on the batch's device.
        batch: latents and prompt embeddings, on the transformer's device.
        noise: like batch.latents.
        sigmas: (B,) noise levels in (0, 1]; the transformer is given σ as its timestep.
        per_sample: each sample's loss (B,) instead of their mean.
    """
    return packed_loss(transformer, batch, noise, sigmas, weighting, packed, per_sample)


# --- sampling -------------------------------------------------------------------------------------------


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
    return denoise_latents(transformer, scheduler, noise, prompt, negative, control_latents, num_inference_steps,
                           true_cfg_scale, progress=progress)  # fmt: skip


def denoise_latents(
    transformer: Any,
    scheduler: Any,
    noise: torch.Tensor,
    prompt: PromptInputs,
    negative: PromptInputs | None,
    controls: Sequence[torch.Tensor],
    steps: int,
    true_cfg_scale: float = 1.0,
    checkpoint: bool = False,
    pipeline_config: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """The pipelines' denoising loop from `noise` (the family's `denoise`): what `sample_latents` runs after drawing
    its noise, and what distillation trains through (with the gradient on and `checkpoint`).

    Args:
        transformer: what is called for each prediction (LoRA or not).
        scheduler: the model's scheduler (not modified: a fresh one is made from its config).
        noise: (B, C, 1, h, w) on the transformer's device, in the dtype the loop runs in.
        prompt, negative: the prompts (B rows, on the device); CFG runs with `negative` and a scale above 1.
        controls: normalised control latents, each (B or 1, C, 1, h, w), in the images' order.
        steps: denoising steps.
        pipeline_config: unused (the Qwen-Image pipelines take no sigmas from their model_index.json).

    Returns:
        Normalised latents (B, C, 1, h, w).
    """
    batch, channels, _, lat_h, lat_w = noise.shape
    device, dtype = noise.device, noise.dtype
    do_cfg = true_cfg_enabled(true_cfg_scale, negative is not None)
    latents = pack_latents(noise[:, :, 0], batch, channels, lat_h, lat_w)
    image_latents, shapes = _packed_controls(controls, batch, channels, device, dtype)
    img_shapes = [[(1, lat_h // 2, lat_w // 2), *shapes]] * batch

    scheduler = type(scheduler).from_config(scheduler.config)
    sigmas = np.linspace(1.0, 1 / steps, steps)
    mu = shift_mu(latents.shape[1], scheduler.config)
    timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)

    def prediction(inputs: PromptInputs, name: str) -> Prediction:
        def call(i: int, t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
            model_input = latents if image_latents is None else torch.cat([latents, image_latents], dim=1)
            timestep = t.expand(batch).to(latents.dtype) / 1000
            # Control tokens follow the target's in the sequence; only the target's are denoised.
            return predict(transformer, name, hidden_states=model_input, timestep=timestep, guidance=None,
                           encoder_hidden_states=inputs.embeds, encoder_hidden_states_mask=inputs.mask,
                           img_shapes=img_shapes, attention_kwargs={})[:, : latents.size(1)]  # fmt: skip

        return call

    uncond = prediction(negative, "uncond") if do_cfg else None
    latents = denoise(scheduler, timesteps, latents, prediction(prompt, "cond"), uncond, true_cfg_scale,
                      rescale=True, progress=progress, checkpoint=checkpoint)  # fmt: skip
    return _unpack_latents(latents, lat_h, lat_w, 1)


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


FAMILY = ModelFamily(
    name="qwen_image",
    variants=VARIANTS,
    part_classes={
        "vae": "diffusers:AutoencoderKLQwenImage",
        "text_encoder": "transformers:Qwen2_5_VLForConditionalGeneration",
        "tokenizer": "transformers:Qwen2Tokenizer",
        "processor": "qie.components.processor:QwenImageProcessorNoVideo",
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
    tiny_presets={name: "qie.components.tiny:build_qwen_image_tiny" for name in
                  ("edit", "edit_plus", "edit_2511", "t2i", "demo")},  # fmt: skip
    real_size={"transformer": real_size.TRANSFORMER, "vae": real_size.VAE, "text_encoder": real_size.TEXT_ENCODER},
    # 8x VAE, 2x2 patches; Qwen2.5-VL sees 28x28-pixel tokens (14 px patches merged 2x2); the template adds ~64.
    planner=PlannerFacts(16, 28 * 28, 64, "Qwen2.5-VL-7B", step_inputs),
    layered=False,
    pipeline=pipeline,
    prompt_template=prompt_template,
    default_size=default_size,
    encode_prompts=encode_prompts,
    encode_latents=encode_latents,
    loss=flow_matching_loss,
    sample=sample,
    denoise=denoise_latents,
    decode=decode_latents,
    vae_scale=vae_scale,
    config_problems=config_problems,
    checkpoint_problems=checkpoint_problems,
    sampling_notes=sampling_notes,
    text_positions=lambda spec, frames: text_positions.qwen_image(frames),
)
