"""What every family's flow matching shares: the noisy input, the velocity loss, the sampling sigmas and shift.

Each family module packs latents its own way and calls its own transformer; the arithmetic around that call
is the same for all of them and lives here once: x_t = (1 - σ)·x0 + σ·noise, the target velocity noise - x0,
the mean (optionally weighted) squared error, the inference sigmas a family names, and the resolution-dependent
shift `mu` of the schedulers.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

# How a pipeline spaces the sigmas of `steps` inference steps, from 1 down (before the scheduler's shift), by name:
# each family's loop names its pipeline's (its `FlowLoop.sigma_schedule`). Both give 1, 1 - 1/N, ..., 1/N,
# but not to the same last bits, and each family samples bitwise as its diffusers pipeline does.
SIGMA_SCHEDULES: dict[str, Callable[[int], np.ndarray]] = {
    # QwenImagePipeline, QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImage21Pipeline (without sample_sigmas)
    "linspace_to_1_over_n": lambda steps: np.linspace(1.0, 1 / steps, steps),
    # QwenImageLayeredPipeline: N + 1 points from 1 to 0, the 0 dropped
    "linspace_to_0_dropped": lambda steps: np.linspace(1.0, 0, steps + 1)[:-1],
}


def noisy_latents(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - σ)·x0 + σ·noise, σ (B,) broadcast over each sample."""
    s = sigmas.to(x0.device, x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
    return (1.0 - s) * x0 + s * noise


def loss_weights(method: str, sigmas: torch.Tensor) -> torch.Tensor:
    """Per-sample loss weights by noise level: "none", "sigma_sqrt" or "cosmap" (SD3's)."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3  # loads diffusers' models: on first use

    return compute_loss_weighting_for_sd3(method, sigmas)


def velocity_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    sigmas: torch.Tensor,
    weighting: str = "none",
    element_weights: torch.Tensor | None = None,
    per_sample: bool = False,
) -> torch.Tensor:
    """Mean squared error between the predicted and the true velocity, weighted per sample by noise level.

    Args:
        pred, target: (B, tokens, features) in the same (packed) layout.
        sigmas: (B,) noise levels.
        weighting: see `loss_weights`.
        element_weights: like `target` (or broadcastable to it), a weight per element (a loss mask packed as
            the latents); each sample's loss is then divided by its mean weight, so an all-ones mask gives
            exactly the unweighted loss and a mask only changes where the loss looks, not its scale.

    Returns:
        The batch mean (a scalar, float32), or with `per_sample` each sample's loss (B,), whose mean it is.
    """
    weights = loss_weights(weighting, sigmas).to(pred.device).view(-1, 1, 1)
    error = weights * (pred.float() - target.float()) ** 2
    batch = pred.shape[0]
    if element_weights is None:
        losses = error.reshape(batch, -1).mean(dim=1)
    else:
        w = element_weights.to(error.device, torch.float32).expand_as(error)
        losses = (error * w).reshape(batch, -1).mean(dim=1) / w.reshape(batch, -1).mean(dim=1).clamp_min(1e-12)
    return losses if per_sample else losses.mean()


def inference_sigmas(schedule: str, steps: int) -> np.ndarray:
    """The sigmas of `steps` inference steps as the schedule named `schedule` (`SIGMA_SCHEDULES`) spaces them."""
    return SIGMA_SCHEDULES[schedule](steps)


def shift_mu(image_seq_len: int, scheduler_config: dict) -> float:
    """The scheduler's dynamic shift for a target of `image_seq_len` tokens: linear in the length between
    (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift), as the Qwen-Image pipelines compute it."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    c = scheduler_config
    return calculate_shift(
        image_seq_len,
        c.get("base_image_seq_len", 256),
        c.get("max_image_seq_len", 4096),
        c.get("base_shift", 0.5),
        c.get("max_shift", 1.15),
    )


def predict(transformer: Any, name: str, **inputs: Any) -> torch.Tensor:
    """One transformer call of a sampling loop, named as the pipelines name it for diffusers' cache hooks
    ("cond", "uncond"); a wrapped model without `cache_context` is called as it is. Returns its output tensor."""
    context = getattr(transformer, "cache_context", None)
    with context(name) if context is not None else nullcontext():
        return transformer(**inputs, return_dict=False)[0]
