"""Qwen-Image-Layered: one RGBA image split into RGBA layers.

Everything here follows diffusers 0.42.1's `QwenImageLayeredPipeline`:
- Prompts: the text alone in the text-to-image template (drop index 34), cut at 512 tokens. (With no prompt the
  pipeline captions the input with its VL model; qie needs a prompt.)
- Sizes: the pipeline's `resolution` bucket (640 or 1024, asserted) is `model.vae_image_pixels` (its square): the
  input is resized to that area at its aspect ratio, and the output has the input's size.
- Latents: the input's RGBA latent is the condition (one frame); the output is `layers + 1` frames of one packed
  sequence, the first the composite (the input again), then the layers in order. `img_shapes` lists every output
  frame, then the condition; the transformer (`use_layer3d_rope`) tells the frames apart by position, and gets
  `additional_t_cond` = 0 for RGBA. The shift `mu` is sqrt(condition tokens / 256).
- Decoding drops the composite frame: the output is the `layers` RGBA layers.
- Training follows from the loop: x_t = (1-σ)·x0 + σ·noise over every frame, σ as the timestep, the prediction
  (cut to the output frames' tokens) regressed onto noise - x0 (`qie.models.flow`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers import QwenImageLayeredPipeline
from diffusers.image_processor import VaeImageProcessor

from qie.models import qwen_image, real_size, text_positions
from qie.models.family import ModelFamily, PlannerFacts, Variant
from qie.models.flavour import Flavour
from qie.models.flow import FlowPrediction, predict
from qie.models.flow_family import FlowLoop
from qie.models.outputs import LAYERS
from qie.models.sampling import Prediction, PromptInputs, SamplingOptions, initial_noise
from qie.types import Batch, pad_prompt_embeds

pack_latents = QwenImageLayeredPipeline._pack_latents
_unpack_latents = QwenImageLayeredPipeline._unpack_latents

# The pipeline's `resolution` buckets and its default layer count (`__call__`'s `layers`).
RESOLUTIONS = (640, 1024)
DEFAULT_LAYERS = 4
VARIANTS = {
    "layered": Variant("QwenImageLayeredPipeline", "none", output_image=0, caption="layered", max_prompt_tokens=512)
}


def encode_prompts(
    pipeline: Any, spec: Any, prompts: Sequence[str], images: Sequence[Sequence[Any]], device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """Prompts as the pipeline encodes them (the text alone, whatever the images), each {"embed": (tokens, dim)}."""
    return [{"embed": e} for e in qwen_image._encode(pipeline, spec, list(prompts), None, device)]


def default_size(spec: Any, vae_scale: int) -> tuple[int, int]:
    """The resolution bucket's square (the pipeline always has an input image, whose aspect it keeps)."""
    side = math.isqrt(spec.vae_image_pixels)
    return side, side


# --- training -------------------------------------------------------------------------------------------


def packed_frames(latents: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """(B, C, F, h, w) -> (B, F * h/2 * w/2, 4C) tokens, frame after frame, and one (1, h/2, w/2) per frame."""
    b, c, f, h, w = latents.shape
    tokens = pack_latents(latents.permute(0, 2, 1, 3, 4), b, c, h, w, f)
    return tokens, [(1, h // 2, w // 2)] * f


def layered_prediction(
    transformer: torch.nn.Module, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor
) -> FlowPrediction:
    """The predicted and the true velocity (noise - x0) of every frame.

    Args:
        transformer: QwenImageTransformer2DModel with layer-aware rope (with or without LoRA).
        batch: `latents` (B, C, 1 + layers, h, w), the composite then each layer; `control_latents` the input's
            latent (B, C, 1, h', w'); prompt embeddings. On the transformer's device.
        noise: like batch.latents.
        sigmas: (B,) noise levels in (0, 1]; the transformer is given σ as its timestep.
    """
    zeros = torch.zeros(batch.latents.shape[0], dtype=torch.long, device=batch.latents.device)
    # additional_t_cond 0: RGBA, as sampled
    return qwen_image.packed_prediction(transformer, batch, noise, sigmas, packed_frames, additional_t_cond=zeros)


# --- sampling -------------------------------------------------------------------------------------------


def sample(
    parts: Any,
    prompt: tuple[torch.Tensor, torch.Tensor | None],
    negative: tuple[torch.Tensor, torch.Tensor | None] | None,
    controls: Sequence[torch.Tensor],
    size: tuple[int, int],
    options: SamplingOptions,
    progress: bool = False,
) -> torch.Tensor:
    """Latents (B, C, 1 + layers, h, w) of `options.num_images` decompositions of the input, step for step as
    `QwenImageLayeredPipeline.__call__` (`options.layers` layers, default 4). The output has the input's size,
    as in the pipeline (`size` does not apply; `sampling_notes` says so)."""
    transformer = parts.transformer
    (control,) = controls
    layers = DEFAULT_LAYERS if options.layers is None else int(options.layers)
    device, dtype = transformer.device, prompt[0].dtype  # noise is drawn in the prompt embeddings' dtype
    batch, channels = options.num_images, transformer.config.in_channels // 4
    lat_h, lat_w = int(control.shape[-2]) // 2 * 2, int(control.shape[-1]) // 2 * 2

    def inputs(embed: torch.Tensor) -> PromptInputs:
        embeds, mask = pad_prompt_embeds([embed] * batch)
        return PromptInputs(embeds.to(device), None if mask is None else mask.to(device))

    generator = torch.Generator("cpu").manual_seed(int(options.seed))
    noise = initial_noise((batch, channels, layers + 1, lat_h, lat_w), generator, device, dtype)
    negative_inputs = inputs(negative[0]) if options.guidance else None
    return LayeredLoop.denoise(
        transformer,
        parts.scheduler,
        noise,
        prompt=inputs(prompt[0]),
        negative=negative_inputs,
        controls=[control.unsqueeze(0)],
        steps=options.num_inference_steps,
        true_cfg_scale=options.true_cfg_scale if options.guidance else 1.0,
        progress=progress,
    )


class LayeredLoop(FlowLoop):
    """The pipeline's denoising run (`FlowLoop.denoise` is the family's `denoise`): every output frame's tokens,
    then the input's; N + 1 sigmas from 1 to 0, the 0 dropped, shifted by the input's length; true CFG without
    rescale (the pipeline's default, no cfg_normalize)."""

    sigma_schedule = "linspace_to_0_dropped"

    def __init__(self, transformer: Any, noise: torch.Tensor, controls: Sequence[torch.Tensor]) -> None:
        (control,) = controls
        batch, _, frames, lat_h, lat_w = noise.shape
        self.transformer, self.size = transformer, (lat_h, lat_w, frames)
        self.latents = packed_frames(noise)[0]
        cond = control.to(device=noise.device, dtype=noise.dtype).expand(batch, -1, -1, -1, -1)
        self.cond_tokens, cond_shapes = packed_frames(cond)
        self.img_shapes = [[(1, lat_h // 2, lat_w // 2)] * frames + cond_shapes] * batch
        self.is_rgb = torch.zeros(batch, dtype=torch.long, device=noise.device)

    def mu(self, scheduler_config: Mapping[str, Any]) -> float:
        """sqrt(condition tokens / 256), as the pipeline has it (not the scheduler's dynamic shift)."""
        return (self.cond_tokens.shape[1] / (256 * 256 / 16 / 16)) ** 0.5

    def prediction(self, inputs: PromptInputs, name: str) -> Prediction:
        def call(i: int, t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
            return predict(
                self.transformer,
                name,
                hidden_states=torch.cat([latents, self.cond_tokens], dim=1),
                timestep=t.expand(latents.shape[0]).to(latents.dtype) / 1000,
                guidance=None,
                img_shapes=self.img_shapes,
                attention_kwargs={},
                additional_t_cond=self.is_rgb,
                encoder_hidden_states=inputs.embeds,
                encoder_hidden_states_mask=inputs.mask,
            )[:, : latents.size(1)]

        return call

    def unpack(self, latents: torch.Tensor) -> torch.Tensor:
        lat_h, lat_w, frames = self.size
        return _unpack_latents(latents, lat_h, lat_w, frames - 1, 1)


@torch.no_grad()
def decode_layers(vae: Any, latents: torch.Tensor, output_type: str = "pil") -> Any:
    """The layers (RGBA) of normalised latents (B, C, 1 + layers, h, w), the composite frame dropped as the
    pipeline drops it: B * layers images, each sample's layers in order ("pil", "np" or "pt")."""
    latents = latents.to(device=vae.device, dtype=vae.dtype)
    z_dim = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
    # Divide by 1/std (not multiply by std) exactly as the pipeline does, so results agree to the last bit.
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
    latents = (latents / inv_std + mean)[:, :, 1:]
    b, c, f, h, w = latents.shape
    images = vae.decode(latents.permute(0, 2, 1, 3, 4).reshape(b * f, c, 1, h, w), return_dict=False)[0]
    processor = VaeImageProcessor(vae_scale_factor=qwen_image.vae_scale(vae) * 2)
    return processor.postprocess(images[:, :, 0], output_type=output_type)


# --- rules ----------------------------------------------------------------------------------------------


def config_problems(spec: Any) -> list[str]:
    """The pipeline's resolution bucket is 640 or 1024 (it asserts so), and it takes exactly one input image."""
    problems = []
    if spec.vae_image_pixels not in {r * r for r in RESOLUTIONS}:
        problems.append(
            f"model.vae_image_pixels={spec.vae_image_pixels}: Qwen-Image-Layered works at its resolution buckets "
            f"only, set it to {RESOLUTIONS[0] ** 2} (640²) or {RESOLUTIONS[1] ** 2} (1024²)"
        )
    if (spec.min_control_images, spec.max_control_images) != (1, 1):
        problems.append("Qwen-Image-Layered splits one input image: set model.min/max_control_images to 1")
    return problems


def checkpoint_problems(spec: Any, read_json: Any) -> list[str]:
    """A Layered checkpoint's transformer has layer-aware rope and the extra timestep condition."""
    config = read_json("transformer/config.json")
    missing = [k for k in ("use_layer3d_rope", "use_additional_t_cond") if config and not config.get(k)]
    return [f"its transformer config lacks {k}=true: it is not a Qwen-Image-Layered transformer" for k in missing]


def sampling_notes(spec: Any, pipeline_config: dict, options: Any) -> list[str]:
    """The pipeline has no height and width: the output always has the input's size."""
    if options.height is not None or options.width is not None:
        return ["predict.height/width do not apply to Qwen-Image-Layered: the layers have the input's size"]
    return []


# --- flavours: the published size and the tiny presets -------------------------------------------------

# The tiny transformer is Qwen-Image's with layer-aware rope and the extra timestep condition. Not 4 latent channels:
# the pipeline takes an input with as many channels as the latents for latents (and an RGBA image has 4), so a
# 4-channel VAE would never encode the input.
TINY_Z_DIM = 8
# The pipeline works at 640² or 1024² only, so the VAE is what makes a tiny model quick: an RGBA VAE of 4 base
# channels that downsamples 16x (five levels, no temporal downsampling: images only), which encodes a 640² image in
# ~1.3 s on one CPU core and turns each frame into 20x20 transformer tokens. Fixed, deliberately non-trivial latent
# statistics so normalisation bugs change results.
TINY_VAE: dict[str, Any] = {
    "base_dim": 4,
    "z_dim": TINY_Z_DIM,
    "dim_mult": [1, 1, 1, 1, 1],
    "num_res_blocks": 1,
    "temperal_downsample": [False, False, False, False],
    "input_channels": 4,
    "latents_mean": [-0.35, 0.2, 0.45, -0.1, 0.05, -0.25, 0.3, 0.1],
    "latents_std": [0.6, 1.35, 0.85, 1.2, 0.95, 1.1, 0.7, 1.25],
}
# The Layered demo's RGBA VAE: the tiny VAE's shape, trained on the demo's layers and shipped with qie (written by
# scripts/train_demo_vae.py --layered). At the pipeline's 640² bucket it encodes a frame in ~0.5 s and decodes one in
# ~0.8 s on one CPU core. (Twice as wide, it stayed at the frames' mean colour for longer than its training takes.)
DEMO_VAE: dict[str, Any] = {k: v for k, v in TINY_VAE.items() if k not in ("latents_mean", "latents_std")}
TINY = qwen_image.TINY.but(
    transformer={
        "in_channels": 4 * TINY_Z_DIM,
        "out_channels": TINY_Z_DIM,
        "use_layer3d_rope": True,
        "use_additional_t_cond": True,
    },
    vae=TINY_VAE,
    pipeline="QwenImageLayeredPipeline",
    tokenizer_pipelines=("QwenImageLayeredPipeline",),
    video_processor=False,
)
FLAVOURS = {
    "published": Flavour(
        {**real_size.TRANSFORMER, "use_layer3d_rope": True, "use_additional_t_cond": True},
        {**real_size.VAE, "input_channels": 4},
        real_size.TEXT_ENCODER,
    ),
    "qwen_image_layered": TINY,
    # The Layered demo's model: the tiny one with the shipped RGBA VAE, so the demo's decoded layers show what the
    # LoRA learned.
    "demo_layered": TINY.but(vae=DEMO_VAE, vae_weights="tiny_demo_layered_vae.safetensors"),
}


FAMILY = ModelFamily(
    name="qwen_image_layered",
    variants=VARIANTS,
    part_classes=dict(qwen_image.FAMILY.part_classes),
    alpha=True,
    patch_size=2,
    blocks="transformer_blocks",
    unused_in_last_block=qwen_image.FAMILY.unused_in_last_block,
    lora_loader="diffusers.loaders:QwenImageLoraLoaderMixin",
    keep_full_precision=qwen_image.FAMILY.keep_full_precision,
    # Qwen-Image's transformer keys and the extra timestep condition (`use_additional_t_cond`): a Layered file
    # matches Qwen-Image's signature too, so the longest matching signature names the family.
    weight_signature=(
        "txt_norm.weight",
        "transformer_blocks.0.txt_mlp.net.0.proj.weight",
        "time_text_embed.addition_t_embedding.weight",
    ),
    flavours=FLAVOURS,
    # 8x VAE, 2x2 patches; the text-only template adds ~34 tokens.
    planner=PlannerFacts(16, 28 * 28, 34, "Qwen2.5-VL-7B", qwen_image.step_inputs),
    pipeline=qwen_image.pipeline,
    prompt_template=qwen_image.prompt_template,
    default_size=default_size,
    encode_prompts=encode_prompts,
    encode_latents=qwen_image.encode_latents,
    predict=layered_prediction,
    sample=sample,
    denoise=LayeredLoop.denoise,
    decode=decode_layers,
    vae_scale=qwen_image.vae_scale,
    config_problems=config_problems,
    checkpoint_problems=checkpoint_problems,
    sampling_notes=sampling_notes,
    text_positions=lambda spec, frames: text_positions.qwen_image(frames, layered=True),
    outputs=LAYERS,
)
