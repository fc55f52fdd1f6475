"""A tiny, randomly initialised Qwen-Image-Layered checkpoint made of the real classes, for tests and dry runs.

`build_tiny_qwen_image_layered` writes a diffusers folder (model_index.json, transformer/, vae/, text_encoder/,
tokenizer/, processor/, scheduler/) that `QwenImageLayeredPipeline.from_pretrained(path,
processor=load_processor(path))` loads. The pipeline works at 640² or 1024² only (it asserts its `resolution`),
so the VAE is what makes a tiny model quick: an RGBA VAE (`input_channels=4`) of 4 base channels that
downsamples 16x (five levels), which encodes a 640² image in ~1.3 s on one CPU core and turns each frame into
20x20 transformer tokens. The transformer is Qwen-Image's with layer-aware rope and the extra timestep condition.

Two presets: `qwen_image_layered` (every part random) and `demo_layered`, the Layered demo's model, whose VAE is
the RGBA VAE trained on the demo's shapes and shipped with qie (`qie.components.tiny_presets`), so that the
demo's decoded layers show what the LoRA learned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import diffusers
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageLayeredPipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLForConditionalGeneration

from qie.components.tiny import (
    IMAGE_PROCESSOR_CONFIG,
    MODEL_INDEX,
    SCHEDULER_CONFIG,
    TRANSFORMER_CONFIG,
    _seeded,
    _text_encoder_config,
    _write_json,
)
from qie.components.tiny_presets import DEMO_LAYERED_VAE_CONFIG, DEMO_LAYERED_VAE_FILE, load_shipped_vae
from qie.components.tiny_tokenizer import build_tokenizer

# Not 4 latent channels: the pipeline takes an input with as many channels as the latents for latents (and an
# RGBA image has 4), so a 4-channel VAE would never encode the input.
Z_DIM = 8
TRANSFORMER: dict[str, Any] = {
    **TRANSFORMER_CONFIG, "in_channels": 4 * Z_DIM, "out_channels": Z_DIM, "use_layer3d_rope": True,
    "use_additional_t_cond": True,
}  # fmt: skip
# Fixed, deliberately non-trivial latent statistics so normalisation bugs change results.
LATENTS_MEAN = [-0.35, 0.2, 0.45, -0.1, 0.05, -0.25, 0.3, 0.1]
LATENTS_STD = [0.6, 1.35, 0.85, 1.2, 0.95, 1.1, 0.7, 1.25]
# 16x down without temporal downsampling (images only), RGBA in and out.
VAE_CONFIG: dict[str, Any] = {
    "base_dim": 4, "z_dim": Z_DIM, "dim_mult": [1, 1, 1, 1, 1], "num_res_blocks": 1,
    "temperal_downsample": [False, False, False, False], "input_channels": 4,
    "latents_mean": LATENTS_MEAN, "latents_std": LATENTS_STD,
}  # fmt: skip


# Preset -> (VAE config, weights shipped with qie) for a trained VAE; a preset not named here has a random one.
SHIPPED_VAES: dict[str, tuple[dict[str, Any], str]] = {
    "demo_layered": (DEMO_LAYERED_VAE_CONFIG, DEMO_LAYERED_VAE_FILE),
}


def build_tiny_qwen_image_layered(path: str | Path, preset: str = "qwen_image_layered", seed: int = 0) -> Path:
    """The tiny Layered checkpoint of `preset` in `path` (the same seed gives bitwise identical weights)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer((QwenImageLayeredPipeline,))
    with _seeded(seed):
        transformer = QwenImageTransformer2DModel(**TRANSFORMER)
    with _seeded(seed + 1):
        shipped = SHIPPED_VAES.get(preset)
        vae = load_shipped_vae(*shipped) if shipped else AutoencoderKLQwenImage(**VAE_CONFIG)
    with _seeded(seed + 2):
        text_encoder = Qwen2_5_VLForConditionalGeneration(_text_encoder_config(tokenizer)).eval()
    transformer.save_pretrained(out / "transformer")
    vae.save_pretrained(out / "vae")
    text_encoder.save_pretrained(out / "text_encoder")
    FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_pretrained(out / "scheduler")
    tokenizer.save_pretrained(out / "tokenizer")
    tokenizer.save_pretrained(out / "processor")
    _write_json(out / "processor" / "preprocessor_config.json", IMAGE_PROCESSOR_CONFIG)
    index = {"_class_name": QwenImageLayeredPipeline.__name__, "_diffusers_version": diffusers.__version__}
    parts = ("scheduler", "vae", "text_encoder", "tokenizer", "processor", "transformer")
    _write_json(out / "model_index.json", {**index, **{name: MODEL_INDEX[name] for name in parts}})
    return out
