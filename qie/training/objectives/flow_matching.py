"""Flow matching, as diffusers trains Qwen-Image: noise and a noise level per sample, the family's velocity
loss (with the batch's loss masks and the configured weighting), times the batch's regularisation weight."""

from __future__ import annotations

from collections.abc import Callable

import torch

from qie.training.objectives import ObjectiveInputs, ObjectiveUse
from qie.training.timesteps import SigmaSampling
from qie.types import Batch

REQUIRES: tuple[str, ...] = ()


def use_problem(use: ObjectiveUse) -> str | None:
    return None  # every family, mode and data mix


def noise_and_sigmas(
    batch: Batch, sigmas: SigmaSampling, g: torch.Generator, patch_size: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian noise shaped as the batch's latents and one sigma per sample, both drawn from `g` (noise first)."""
    latents = batch.latents
    noise = torch.randn(latents.shape, generator=g, dtype=torch.float32).to(latents.device, latents.dtype)
    tokens = (latents.shape[-2] // patch_size) * (latents.shape[-1] // patch_size)
    return noise, sigmas.sample(latents.shape[0], g, tokens)


class FlowMatching:
    """The flow-matching objective.

    Args:
        family_loss: the model family's loss (`ModelFamily.loss`): (model, batch, noise, sigmas, weighting).
        sigmas: how noise levels are drawn (the target's token count decides dynamic shifting).
        patch_size: latent pixels per side of one transformer token.
        weighting: the loss weighting over sigmas (`train.loss_weighting`).
    """

    def __init__(self, family_loss: Callable[..., torch.Tensor], sigmas: SigmaSampling, patch_size: int,
                 weighting: str = "none") -> None:  # fmt: skip
        self.family_loss, self.sigmas, self.patch_size, self.weighting = family_loss, sigmas, patch_size, weighting

    def prepare(self, transformer: torch.nn.Module) -> None:
        pass  # the trained model alone

    def loss(self, model: torch.nn.Module, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        noise, sigmas = noise_and_sigmas(batch, self.sigmas, generator, self.patch_size)
        out = self.family_loss(model, batch, noise, sigmas, self.weighting)
        # Regularisation batches weigh `data.regularization.weight`; every other batch 1.
        return out if batch.loss_weight == 1.0 else out * batch.loss_weight

    def step_metrics(self) -> dict[str, float]:
        return {}  # the loss says it all

    @torch.no_grad()
    def evaluate(
        self, model: torch.nn.Module, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor
    ) -> dict[str, float]:
        return {"loss": self.family_loss(model, batch, noise, sigmas, "none").item()}


def build(inputs: ObjectiveInputs) -> FlowMatching:
    return FlowMatching(inputs.family.loss, inputs.sigmas, inputs.family.patch_size, inputs.loss_weighting)
