"""Sigma (noise level) sampling for flow-matching training, and its loss weighting.

Qwen-Image's scheduler shifts sigmas dynamically at inference, so a fixed `shift` given to it is ignored:
the training distribution of sigmas is set here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qie.models.flow import loss_weights, shift_mu


@dataclass(frozen=True)
class SigmaSampling:
    """How training draws its noise levels: the one place the methods and their defaults are written.

    Args:
        method: "uniform", "logit_normal", "mode" (SD3's densities) or "shift": uniform sigmas pushed towards
            noise by s*σ / (1 + (s-1)*σ).
        logit_mean, logit_std: "logit_normal"'s; mode_scale: "mode"'s.
        shift: "shift"'s s.
        dynamic_shift: with "shift", pick s = exp(mu) from the target's token count, as Qwen-Image's scheduler does
            at inference (calculate_shift with the scheduler's config).
        scheduler_config: the model's scheduler config: its base/max shift and sequence lengths, for `dynamic_shift`.
    """

    method: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: float = 3.0
    dynamic_shift: bool = False
    scheduler_config: dict = field(default_factory=dict)

    def sample(self, batch_size: int, generator: torch.Generator, image_seq_len: int = 4096) -> torch.Tensor:
        """`batch_size` sigmas in (0, 1] for targets of `image_seq_len` packed tokens, drawn from `generator`."""
        # diffusers' training utilities load its models and pipelines: imported where sigmas are drawn, not when
        # a stage's modules are (an entry point answers a config mistake without them).
        from diffusers.training_utils import compute_density_for_timestep_sampling

        scheme = "uniform" if self.method == "shift" else self.method
        u = compute_density_for_timestep_sampling(
            scheme,
            batch_size,
            logit_mean=self.logit_mean,
            logit_std=self.logit_std,
            mode_scale=self.mode_scale,
            generator=generator,
        )
        if self.method == "shift":
            s = torch.tensor(self.shift, dtype=u.dtype)
            if self.dynamic_shift:
                mu = shift_mu(image_seq_len, self.scheduler_config or {})
                s = torch.tensor(mu, dtype=u.dtype).exp()
            u = s * u / (1 + (s - 1) * u)
        # σ=0 would be a clean input with no noise to predict; keep away from both ends.
        return u.clamp(1e-4, 1.0)


__all__ = ["SigmaSampling", "loss_weights"]
