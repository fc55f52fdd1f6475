"""Sizes of qie's tiny models: one builder (`qie.components.tiny`), presets that only fill in numbers.

- `default`: the smallest sizes that run every code path, all weights random (tests).
- `demo`: a larger transformer and a VAE trained on the demo's synthetic shapes, so that the demo's images
  show what the LoRA learned. The VAE weights ship with qie (`tiny_demo_vae.safetensors`, written by
  `scripts/train_demo_vae.py`); their metadata holds the VAE config and the latent statistics of the
  trained encoder, which become the VAE's `latents_mean` / `latents_std`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage
from safetensors import safe_open

from qie.errors import ModelLoadError

TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
    "num_attention_heads": 3, "joint_attention_dim": 16, "guidance_embeds": False,
    "axes_dims_rope": (8, 4, 4),
}  # fmt: skip
Z_DIM = 4
# Fixed, deliberately non-trivial latent statistics so normalisation bugs change results.
LATENTS_MEAN = [-0.35, 0.2, 0.45, -0.1]
LATENTS_STD = [0.6, 1.35, 0.85, 1.2]
VAE_CONFIG: dict[str, Any] = {
    "base_dim": 24, "z_dim": Z_DIM, "dim_mult": [1, 2, 4], "num_res_blocks": 1,
    "temperal_downsample": [False, True], "latents_mean": LATENTS_MEAN, "latents_std": LATENTS_STD,
}  # fmt: skip

DEMO_Z_DIM = 8
# Images only (one frame), so no temporal downsampling: no unused time convolutions in the file.
DEMO_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 16, "z_dim": DEMO_Z_DIM, "dim_mult": [1, 2, 2], "num_res_blocks": 1,
    "temperal_downsample": [False, False],
}  # fmt: skip
DEMO_TRANSFORMER_CONFIG: dict[str, Any] = {
    **TRANSFORMER_CONFIG, "in_channels": 4 * DEMO_Z_DIM, "out_channels": DEMO_Z_DIM, "num_layers": 4,
    "attention_head_dim": 32, "num_attention_heads": 4, "axes_dims_rope": (8, 12, 12),
}  # fmt: skip
DEMO_VAE_FILE = "tiny_demo_vae.safetensors"


@dataclass(frozen=True)
class TinyPreset:
    """Constructor arguments of the tiny transformer and VAE; `vae_weights` names trained VAE weights
    shipped in this package (None: random weights)."""

    transformer: dict[str, Any] = field(default_factory=lambda: dict(TRANSFORMER_CONFIG))
    vae: dict[str, Any] = field(default_factory=lambda: dict(VAE_CONFIG))
    vae_weights: str | None = None


PRESETS: dict[str, TinyPreset] = {
    "default": TinyPreset(),
    "demo": TinyPreset(DEMO_TRANSFORMER_CONFIG, DEMO_VAE_CONFIG, DEMO_VAE_FILE),
}


def get_preset(name: str) -> TinyPreset:
    """The preset called `name`. Raises ValueError for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"unknown tiny model preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]


def build_vae(preset: TinyPreset) -> AutoencoderKLQwenImage:
    """The preset's VAE: randomly initialised (seed it outside), or loaded from its shipped weights.

    Raises:
        ModelLoadError: the weights file is missing or was made for another VAE config.
    """
    if preset.vae_weights is None:
        return AutoencoderKLQwenImage(**preset.vae)
    tensors, meta = read_vae_weights(preset.vae_weights)
    if json.loads(meta["config"]) != json.loads(json.dumps(preset.vae)):
        raise ModelLoadError(
            f"{preset.vae_weights} holds a VAE of config {meta['config']}, not {preset.vae}: "
            "rerun scripts/train_demo_vae.py"
        )
    stats = {k: json.loads(meta[k]) for k in ("latents_mean", "latents_std")}
    vae = AutoencoderKLQwenImage(**preset.vae, **stats)
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
