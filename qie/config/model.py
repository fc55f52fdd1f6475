"""Schema of the `model` group: which checkpoint, in which dtype, with which condition sizes.

One yaml per model (`model=NAME`) fills it; `qie.models.model_spec` turns it into the model description
every stage reads (pipeline class, prompt template, control counts, output size, parts to build).
"""

from dataclasses import dataclass
from enum import Enum

from omegaconf import MISSING


class Variant(str, Enum):
    """Pipeline family: Edit takes one control image, Edit-Plus several, text-to-image none."""

    edit = "edit"
    edit_plus = "edit_plus"
    text_to_image = "text_to_image"


class Dtype(str, Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Quantize(str, Enum):
    """Weight quantization of a frozen part (optimum-quanto): its linear layers in 8 bits."""

    none = "none"
    fp8 = "fp8"
    int8 = "int8"


@dataclass
class ModelConfig:
    name: str = MISSING
    variant: Variant = Variant.edit
    # Hub id or local diffusers-format folder.
    pretrained_model_name_or_path: str = MISSING
    # A transformer to use instead of the base model's (a merged or fully fine-tuned one): its diffusers
    # folder, or the folder holding it as transformer/. The other parts come from the base model.
    transformer_path: str | None = None
    revision: str | None = None
    # A tiny preset (edit, edit_plus, edit_2511, t2i): qie builds that tiny random model at
    # `pretrained_model_name_or_path` when it is not there yet. null for real checkpoints.
    tiny: str | None = None
    dtype: Dtype = Dtype.bfloat16
    quantize: Quantize = Quantize.none
    # The text encoder's linear layers in 8 bits (precompute, lazy and live modes): Qwen2.5-VL-7B needs
    # ~9 GiB instead of 15.4. Part of the prompt embeddings' cache keys.
    text_encoder_quantize: Quantize = Quantize.none
    # Areas (pixels) the pipeline resizes condition images to, for the VAE and for Qwen2.5-VL.
    vae_image_pixels: int = 1024 * 1024
    vl_image_pixels: int = 1024 * 1024
    # Control images one sample may have; 0 as the minimum lets a sample without one train through the
    # pipeline's text-only prompt (Edit-Plus), 0 as the maximum is a text-to-image model.
    min_control_images: int = 1
    max_control_images: int = 1
    # Whether the checkpoint's transformer gives control tokens timestep 0 (Edit-2511): its config must agree.
    zero_cond_t: bool = False
    # Compare the checkpoint's model_index.json and transformer config with this description at start-up.
    check: bool = True
