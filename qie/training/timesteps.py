"""Sigma (noise level) sampling for flow-matching training, and its loss weighting.

Qwen-Image's scheduler shifts sigmas dynamically at inference, so a fixed `shift` given to it is ignored:
the training distribution of sigmas is set here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers.training_utils import compute_density_for_timestep_sampling

from qie.models.flow import loss_weights, shift_mu


def sample_sigmas(
    batch_size: int,
    generator: torch.Generator,
    method: str = "logit_normal",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    shift: float = 3.0,
    dynamic_shift: bool = False,
    image_seq_len: int = 4096,
    scheduler_config: dict | None = None,
) -> torch.Tensor:
    """Sigmas in (0, 1], one per sample.

    Args:
        method: "uniform", "logit_normal", "mode" (SD3's densities) or "shift": uniform sigmas pushed
            towards noise by s*σ / (1 + (s-1)*σ).
        dynamic_shift: with "shift", pick s = exp(mu) from the target's token count, as Qwen-Image's
            scheduler does at inference (calculate_shift with the scheduler's config).
        image_seq_len: packed tokens of one target latent.
    """
    scheme = "uniform" if method == "shift" else method
    u = compute_density_for_timestep_sampling(
        scheme,
        batch_size,
        logit_mean=logit_mean,
        logit_std=logit_std,
        mode_scale=mode_scale,
        generator=generator,
    )
    if method == "shift":
        s = torch.tensor(shift, dtype=u.dtype)
        if dynamic_shift:
            mu = shift_mu(image_seq_len, scheduler_config or {})
            s = torch.tensor(mu, dtype=u.dtype).exp()
        u = s * u / (1 + (s - 1) * u)
    # σ=0 would be a clean input with no noise to predict; keep away from both ends.
    return u.clamp(1e-4, 1.0)


@dataclass(frozen=True)
class SigmaSampling:
    """How training draws its noise levels (see `sample_sigmas` for the meaning of each field)."""

    method: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: float = 3.0
    dynamic_shift: bool = False
    # The model's scheduler config: its base/max shift and sequence lengths, for `dynamic_shift`.
    scheduler_config: dict = field(default_factory=dict)

    def sample(self, batch_size: int, generator: torch.Generator, image_seq_len: int) -> torch.Tensor:
        """`batch_size` sigmas for targets of `image_seq_len` packed tokens."""
        return sample_sigmas(
            batch_size,
            generator,
            method=self.method,
            logit_mean=self.logit_mean,
            logit_std=self.logit_std,
            mode_scale=self.mode_scale,
            shift=self.shift,
            dynamic_shift=self.dynamic_shift,
            image_seq_len=image_seq_len,
            scheduler_config=self.scheduler_config,
        )


__all__ = ["SigmaSampling", "loss_weights", "sample_sigmas"]
