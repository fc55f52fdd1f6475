"""The VAEs shipped with qie for the demos' tiny models, trained on the demo's synthetic shapes.

Two VAEs: an RGB one for the Edit demo (the Qwen-Image family's `demo` flavour) and an RGBA one for the Layered demo
(Qwen-Image-Layered's `demo_layered`), written by `scripts/train_demo_vae.py` (`--layered`). Their sizes and file
names are the flavours' (`qie.models.qwen_image.FLAVOURS`, `qie.models.qwen_image_layered.FLAVOURS`; named below for
the training script). Each file carries its VAE config and the latent statistics of the trained encoder in its
metadata; those become the VAE's `latents_mean` / `latents_std`, so the demos' images show what the LoRA learned.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage
from safetensors import safe_open

from qie.errors import ModelLoadError
from qie.models import qwen_image, qwen_image_layered

_DEMO, _DEMO_LAYERED = qwen_image.FLAVOURS["demo"], qwen_image_layered.FLAVOURS["demo_layered"]
DEMO_VAE_CONFIG: dict[str, Any] = dict(_DEMO.vae)
DEMO_VAE_FILE: str = _DEMO.tiny.vae_weights
DEMO_LAYERED_VAE_CONFIG: dict[str, Any] = dict(_DEMO_LAYERED.vae)
DEMO_LAYERED_VAE_FILE: str = _DEMO_LAYERED.tiny.vae_weights
DEMO_Z_DIM: int = DEMO_VAE_CONFIG["z_dim"]


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
