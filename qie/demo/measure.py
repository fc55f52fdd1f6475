"""How the demo measures a model's outputs: pixel errors of images and of RGBA layers, latent errors of frames,
and the VAE's reconstruction PSNR."""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

from qie.models import ModelSpec


def pixel_error(images: list[Image.Image], targets: list[np.ndarray]) -> float:
    """Mean absolute difference of the images from their targets, pixels in [0, 1]."""
    errors = []
    for image, target in zip(images, targets):
        pred = np.asarray(image.convert("RGB").resize(target.shape[1::-1]), dtype=np.float32) / 255.0
        errors.append(float(np.abs(pred - target[..., :3]).mean()))
    return float(np.mean(errors))


def layer_error(image: Image.Image, target: np.ndarray) -> float:
    """Mean absolute difference of an RGBA layer from its target (H, W, 4) in [0, 1], both premultiplied by
    their alpha: where a layer is transparent its colour does not count."""
    pred = np.asarray(image.convert("RGBA").resize(target.shape[1::-1]), dtype=np.float32) / 255.0

    def premultiplied(x: np.ndarray) -> np.ndarray:
        return np.concatenate([x[..., :3] * x[..., 3:], x[..., 3:]], axis=-1)

    return float(np.abs(premultiplied(pred) - premultiplied(target)).mean())


def by_position(errors: list[list[float]]) -> list[float]:
    """Per layer position (0: the background), the mean of the samples' errors at that position."""
    positions: dict[int, list[float]] = {}
    for sample in errors:
        for n, error in enumerate(sample):
            positions.setdefault(n, []).append(error)
    return [float(np.mean(positions[n])) for n in sorted(positions)]


def mean_of_all(errors: list[list[float]]) -> float:
    return float(np.mean([e for sample in errors for e in sample]))


def frame_errors(latents: torch.Tensor, target: torch.Tensor) -> list[float]:
    """Mean absolute difference of each frame of normalised latents (C, frames, h, w) from the target's."""
    return [float((latents[:, n].float().cpu() - target[:, n]).abs().mean()) for n in range(target.shape[1])]


def vae_psnr(
    vae: torch.nn.Module, frames: list[list[np.ndarray]], encoded: list[torch.Tensor], spec: ModelSpec
) -> float:
    """PSNR (dB) of each sample's frames (H, W, C) in [0, 1] decoded by the model's VAE from their latents
    (`encoded`, the cached entries: encoded as the pipelines encode; a layered model's decoder drops the composite
    frame: its layers count)."""
    squared = []
    for sample_frames, latent in zip(frames, encoded):
        decoded = spec.family.decode(vae, latent.unsqueeze(0), output_type="np")
        expected = np.stack(sample_frames[len(sample_frames) - len(decoded) :])
        squared.append(float(((np.asarray(decoded) - expected) ** 2).mean()))
    return 10 * math.log10(1.0 / max(float(np.mean(squared)), 1e-12))
