"""A per-sample weighting written outside qie: min-SNR-γ (Hang et al. 2023) on flow matching. With
x_t = (1 - σ) x0 + σ ε the signal-to-noise ratio is ((1 - σ) / σ)²; a velocity target is weighted by
min(SNR, γ) / (SNR + 1), which keeps the many easy low-noise steps from dominating the loss."""

from __future__ import annotations

from typing import Any

import torch

from qie.extend import Batch, FlowMatching, ObjectiveContext


class MinSnr(FlowMatching):
    """Flow matching with each sample's loss weighted by min(SNR, gamma) / (SNR + 1)."""

    def __init__(self, context: ObjectiveContext, gamma: float = 5.0, **kwargs: Any) -> None:
        super().__init__(context, **kwargs)
        self.gamma = gamma

    def weights(self, sigmas: torch.Tensor) -> torch.Tensor:
        snr = ((1 - sigmas.double()) / sigmas.double()) ** 2
        return (snr.clamp(max=self.gamma) / (snr + 1)).float()

    def loss(self, model: torch.nn.Module, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        noise, sigmas = self.context.noise_and_sigmas(batch, generator)  # sigmas: [B], in (0, 1)
        per_sample = self.context.flow_loss(model, batch, noise, sigmas)  # [B]
        return (self.weights(sigmas).to(per_sample.device) * per_sample).mean() * batch.loss_weight
