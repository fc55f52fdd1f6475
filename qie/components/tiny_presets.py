"""The demo's tiny model sizes and its VAEs, trained on the demo's synthetic shapes and shipped with qie.

Two VAEs: an RGB one for the Edit demo (`tiny_demo_vae.safetensors`, written by `scripts/train_demo_vae.py`) and
an RGBA one for the Layered demo (`tiny_demo_layered_vae.safetensors`, written by `scripts/train_demo_vae.py
--layered`). Each file carries its VAE config and the latent statistics of the trained encoder in its metadata;
those become the VAE's `latents_mean` / `latents_std`. The `demo` preset of `qie.components.tiny` and the
`demo_layered` preset of `qie.components.tiny_qwen_image_layered` use them, so the demos' images show what the
LoRA learned.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage
from safetensors import safe_open

from qie.errors import ModelLoadError

DEMO_Z_DIM = 8
# Images only (one frame), so no temporal downsampling: no unused time convolutions in the file.
DEMO_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 16, "z_dim": DEMO_Z_DIM, "dim_mult": [1, 2, 2], "num_res_blocks": 1,
    "temperal_downsample": [False, False],
}  # fmt: skip
# Entries that differ from the tiny transformer's config.
DEMO_TRANSFORMER: dict[str, Any] = {
    "in_channels": 4 * DEMO_Z_DIM, "out_channels": DEMO_Z_DIM, "num_layers": 4,
    "attention_head_dim": 32, "num_attention_heads": 4, "axes_dims_rope": (8, 12, 12),
}  # fmt: skip
DEMO_VAE_FILE = "tiny_demo_vae.safetensors"
# The Layered demo's RGBA VAE: the tiny Layered model's VAE (RGBA in and out, 16x down without temporal
# downsampling, 8 latent channels; `qie.components.tiny_qwen_image_layered`), trained. At the pipeline's 640² bucket
# it encodes a frame in ~0.5 s and decodes one in ~0.8 s on one CPU core. (Twice as wide, it stayed at the frames'
# mean colour for longer than its training takes.)
DEMO_LAYERED_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 4, "z_dim": DEMO_Z_DIM, "dim_mult": [1, 1, 1, 1, 1], "num_res_blocks": 1,
    "temperal_downsample": [False, False, False, False], "input_channels": 4,
}  # fmt: skip
DEMO_LAYERED_VAE_FILE = "tiny_demo_layered_vae.safetensors"


def load_shipped_vae(config: dict[str, Any], name: str) -> AutoencoderKLQwenImage:
    """The VAE of `config` with the weights shipped in `qie.components` as `name`.

    Raises:
        ModelLoadError: the weights file is missing or was made for another VAE config.
    """
    tensors, meta = read_vae_weights(name)
    if json.loads(meta["config"]) != json.loads(json.dumps(config)):
        raise ModelLoadError(
            f"{name} holds a VAE of config {meta['config']}, not {config}: rerun scripts/train_demo_vae.py"
        )
    stats = {k: json.loads(meta[k]) for k in ("latents_mean", "latents_std")}
    vae = AutoencoderKLQwenImage(**config, **stats)
    vae.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    return vae


def read_vae_weights(name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a weights file shipped in `qie.components`.

    Raises:
        ModelLoadError: the file is not there (an install without the package data).
    """
    path = resources.files("qie.components") / name
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing: reinstall qie, or write it with scripts/train_demo_vae.py")
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
