"""Schema of the `model` group: which checkpoint, in which dtype, with which condition sizes.

One yaml per model (`model=NAME`) fills it; `qie.models.model_spec` turns it into the model description
every stage reads (pipeline class, prompt template, control counts, output size, parts to build).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from omegaconf import MISSING

from qie.config.ranges import first, out_of_range


class Dtype(StrEnum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Quantize(StrEnum):
    """Weight quantization of the frozen transformer's linear layers: 8 bits (fp8, int8) or 4 bits through
    optimum-quanto (int4: any device), 4-bit NormalFloat through bitsandbytes (nf4: CUDA only, `qie[bnb]`)."""

    none = "none"
    fp8 = "fp8"
    int8 = "int8"
    int4 = "int4"
    nf4 = "nf4"


class Fp8Compute(StrEnum):
    """Whether `model.quantize=fp8` weights also compute in fp8 (torchao's float8 products, `qie[fp8]`)."""

    # where it pays: the transformer on a GPU with fp8 tensor cores (compute capability 8.9+), its blocks compiled
    auto = "auto"
    always = "always"  # everywhere (on the CPU emulated: for tests, slow)
    never = "never"  # optimum-quanto's fp8 weights, widened to bf16 for each product


class TextEncoderQuantize(StrEnum):
    """Weight quantization of the frozen text encoder (optimum-quanto): its linear layers in 8 bits."""

    none = "none"
    fp8 = "fp8"
    int8 = "int8"


class SingleFileFp8(StrEnum):
    """What becomes of fp8 weights in a `model.transformer_path` file."""

    upcast = "upcast"  # times their scales, in `model.dtype`
    keep = "keep"  # the file's fp8 bytes and scales, as optimum-quanto fp8 weights


@dataclass
class ModelConfig:
    name: str = MISSING
    # The pipeline: a variant of a model family (`qie.models`): edit (one control image), edit_plus (several),
    # text_to_image (none), qwen_image_21 (text to image and up to 10 references). Checked when composed.
    variant: str = "edit"
    # Hub id or local diffusers-format folder.
    pretrained_model_name_or_path: str = MISSING
    # A transformer to use instead of the base model's (a merged or fully fine-tuned one): its diffusers
    # folder, the folder holding it as transformer/, or one .safetensors file (diffusers' single-file layout or
    # ComfyUI's, fp8 and fp8-scaled files upcast to `dtype`). The other parts come from the base model.
    transformer_path: str | None = None
    # A VAE or text encoder from one file (as ComfyUI keeps them) is refused when composed, naming what to pass
    # instead: neither diffusers 0.42.1 (no single-file loader for these VAE classes) nor transformers (no
    # single-file loader) reads them. The base model's folder or hub id provides both.
    vae_path: str | None = None
    text_encoder_path: str | None = None
    # fp8 weights of a transformer file: upcast to `dtype` (times their scales), or kept as the file stores them
    # (the file's fp8 bytes and per-tensor scales held by optimum-quanto; not with model.quantize).
    single_file_fp8: SingleFileFp8 = SingleFileFp8.upcast
    revision: str | None = None
    # LoRA files fused into the transformer's weights before training, validation and inference (a Lightning
    # few-step LoRA, say: a LoRA trained on that base keeps its effect at 4 or 8 steps), any format qie reads, each
    # at its `fuse_lora_scales` entry (none given: 1.0 each). A LoRA trained on a fused base records the files'
    # fingerprints and scales; inference refuses it on another base unless `predict.allow_other_base=true`.
    fuse_loras: list[str] = field(default_factory=list)
    fuse_lora_scales: list[float] = field(default_factory=list)
    # A tiny preset (edit, edit_plus, edit_2511, t2i, demo, qwen_image_21, qwen_image_layered, demo_layered: each
    # family names its own): qie builds that tiny model at `pretrained_model_name_or_path` when it is not there yet.
    # null for real checkpoints.
    tiny: str | None = None
    dtype: Dtype = Dtype.bfloat16
    quantize: Quantize = Quantize.none
    # fp8 weights computed in fp8 on GPUs that have fp8 tensor cores (Ada, Hopper and newer) when the blocks are
    # compiled (train.compile / predict.compile), where it measured faster than bf16 (docs/benchmarks.md §7).
    # Not with block swap or FSDP (auto falls back to optimum-quanto's fp8 there).
    fp8_compute: Fp8Compute = Fp8Compute.auto
    # The text encoder's linear layers in 8 bits (precompute, lazy and live modes): Qwen2.5-VL-7B needs
    # ~9 GiB instead of 15.4. Part of the prompt embeddings' cache keys.
    text_encoder_quantize: TextEncoderQuantize = TextEncoderQuantize.none
    # Areas (pixels) the pipeline resizes condition images to, for the VAE and for the vision-language
    # encoder (Qwen-Image-2.1: both its `output_resolution`², and its text-to-image size is that square).
    vae_image_pixels: int = 1024 * 1024
    vl_image_pixels: int = 1024 * 1024
    # Control images one sample may have; 0 as the minimum lets a sample without one train through the
    # pipeline's text-only prompt (Edit-Plus), 0 as the maximum is a text-to-image model.
    min_control_images: int = 1
    max_control_images: int = 1
    # Whether the checkpoint's transformer gives control tokens timestep 0 (Edit-2511): its config must agree.
    zero_cond_t: bool = False
    # The LoRA targets `train.lora.target_modules` defaults to: the transformer's projection layers.
    lora_target_modules: list[str] = field(
        default_factory=lambda: [
            "to_q",
            "to_k",
            "to_v",
            "to_out.0",
            "add_q_proj",
            "add_k_proj",
            "add_v_proj",
            "to_add_out",
        ]
    )
    # The pipeline's own sampling defaults (its `__call__`'s: Qwen-Image and Edit 4.0 and 50, 2.1 1.0 and 40),
    # which the `predict` group takes unless set there.
    true_cfg_scale: float = 4.0
    num_inference_steps: int = 50
    # Compare the checkpoint's model_index.json and transformer config with this description at start-up.
    check: bool = True

    @classmethod
    def of_values(cls, values: Mapping[str, Any]) -> ModelConfig:
        """A model config from plain values read without Hydra (a model yaml's, a run's recorded config): its own
        keys over the schema's defaults, each as written (interpolations unresolved); keys the schema lacks are left
        out."""
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in values.items() if key in names})

    def problem(self) -> str | None:
        """The first of the image areas and control-image counts out of range, as one line."""
        return first(
            out_of_range("model.vae_image_pixels", self.vae_image_pixels, 32 * 32),
            out_of_range("model.vl_image_pixels", self.vl_image_pixels, 28 * 28),
            out_of_range("model.min_control_images", self.min_control_images, 0),
            out_of_range("model.max_control_images", self.max_control_images, self.min_control_images),
            out_of_range("model.num_inference_steps", self.num_inference_steps, 1),
        )
