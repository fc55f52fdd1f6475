"""The demo's tiny model sizes and its VAE, trained on the demo's synthetic shapes and shipped with qie.

The weights (`tiny_demo_vae.safetensors`, written by `scripts/train_demo_vae.py`) carry the VAE config and
the latent statistics of the trained encoder in their metadata; those become the VAE's `latents_mean` /
`latents_std`. The `demo` preset of `qie.components.tiny` uses them, so the demo's images show what the
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
