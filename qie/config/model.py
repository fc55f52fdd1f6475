"""Schema of the `model` group: which checkpoint, in which dtype, with which condition sizes."""

from dataclasses import dataclass
from enum import Enum

from omegaconf import MISSING


class Variant(str, Enum):
    """Pipeline family: Edit takes one control image, Edit-Plus several."""

    edit = "edit"
    edit_plus = "edit_plus"


class TinyPreset(str, Enum):
    """Sizes of qie's tiny model (`qie.components.tiny_presets`): random weights, or the demo's trained VAE."""

    default = "default"
    demo = "demo"


class Dtype(str, Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Quantize(str, Enum):
    """Weight quantization of the frozen transformer (optimum-quanto)."""

    none = "none"
    fp8 = "fp8"
    int8 = "int8"


@dataclass
class ModelConfig:
    name: str = MISSING
    variant: Variant = Variant.edit
    # Hub id or local diffusers-format folder.
    pretrained_model_name_or_path: str = MISSING
    revision: str | None = None
    # Build qie's tiny random model at `pretrained_model_name_or_path` when it is not there yet.
    tiny: bool = False
    tiny_preset: TinyPreset = TinyPreset.default
    dtype: Dtype = Dtype.bfloat16
    quantize: Quantize = Quantize.none
    # Areas (pixels) the pipeline resizes condition images to, for the VAE and for Qwen2.5-VL.
    vae_image_pixels: int = 1024 * 1024
    vl_image_pixels: int = 1024 * 1024
    max_control_images: int = 1
