"""Flow matching, as diffusers trains Qwen-Image: noise and a noise level per sample, the family's velocity
loss (with the batch's loss masks and the configured weighting), times the batch's regularisation weight.

`FlowMatching` is also the base a new objective usually extends: a subclass adds keyword settings to
`__init__(*args, **kwargs)`, adds sample fields with `requires = FlowMatching.requires | {FIELD}`, calls
`super().loss(model, batch, generator)` and returns its own measures from `step_metrics()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from qie.training.objectives import ObjectiveInputs, ObjectiveUse
from qie.types import Batch

if TYPE_CHECKING:  # for annotations: a plug-in importing the base loads no model library
    from qie.training.timesteps import SigmaSampling


def noise_and_sigmas(
    batch: Batch, sigmas: SigmaSampling, g: torch.Generator, patch_size: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian noise shaped as the batch's latents and one sigma per sample, both drawn from `g` (noise first)."""
    latents = batch.latents
    noise = torch.randn(latents.shape, generator=g, dtype=torch.float32).to(latents.device, latents.dtype)
    tokens = (latents.shape[-2] // patch_size) * (latents.shape[-1] // patch_size)
    return noise, sigmas.sample(latents.shape[0], g, tokens)


class FlowMatching:
    """The flow-matching objective (`train/objective=flow_matching`, no settings of its own).

    Args:
        inputs: the family's loss (`ModelFamily.loss`: model, batch, noise, sigmas, weighting) and patch size, how
            noise levels are drawn (the target's token count decides dynamic shifting) and the loss weighting over
            sigmas (`train.loss_weighting`).
    """

    # The sample fields trained on: a target for every sample.
    requires: ClassVar[frozenset[Any]] = frozenset({"target"})

    def __init__(self, inputs: ObjectiveInputs) -> None:
        self.inputs = inputs
        self.family_loss = inputs.family.loss
        self.sigmas, self.patch_size = inputs.sigmas, inputs.family.patch_size
        self.weighting = inputs.loss_weighting

    @classmethod
    def use_problem(cls, use: ObjectiveUse) -> str | None:
        """Why this objective cannot train the run `use` describes (one line), or None."""
        return None  # every family, mode and data mix

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
