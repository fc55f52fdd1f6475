"""Flow matching, as diffusers trains Qwen-Image: noise and a noise level per sample, the family's velocity
loss (with the batch's loss masks and the configured weighting), times the batch's regularisation weight.

`FlowMatching` is also the base a new objective usually extends: a subclass adds keyword settings to
`__init__(context, ..., **kwargs)`, adds sample fields with `requires = FlowMatching.requires | {FIELD}`, asks its
context (`self.context`) for what it uses, and returns its own measures from `step_metrics()`. A per-sample
weighting is three lines:

    noise, sigmas = self.context.noise_and_sigmas(batch, generator)
    per_sample = self.context.flow_loss(model, batch, noise, sigmas)  # (B,)
    return (weights(sigmas) * per_sample).mean()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from qie.training.objectives import ObjectiveUse
from qie.types import Batch

if TYPE_CHECKING:  # for annotations: a plug-in importing the base loads no model library
    from qie.training.objectives.context import ObjectiveContext


class FlowMatching:
    """The flow-matching objective (`train/objective=flow_matching`, no settings of its own).

    Args:
        context: what the run gives (`ObjectiveContext`): noise and noise levels (the target's token count decides
            dynamic shifting) and the family's flow loss under the run's weighting over sigmas
            (`train.loss_weighting`). Kept as `self.context`.
    """

    # The sample fields trained on: a target for every sample.
    requires: ClassVar[frozenset[Any]] = frozenset({"target"})

    def __init__(self, context: ObjectiveContext) -> None:
        self.context = context

    @classmethod
    def use_problem(cls, use: ObjectiveUse) -> str | None:
        """Why this objective cannot train the run `use` describes (one line), or None."""
        return None  # every family, mode and data mix

    def prepare(self, transformer: torch.nn.Module) -> None:
        pass  # the trained model alone

    def loss(self, model: torch.nn.Module, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        noise, sigmas = self.context.noise_and_sigmas(batch, generator)
        out = self.context.flow_loss(model, batch, noise, sigmas).mean()
        # Regularisation batches weigh `data.regularization.weight`; every other batch 1.
        return out if batch.loss_weight == 1.0 else out * batch.loss_weight

    def step_metrics(self) -> dict[str, float]:
        return {}  # the loss says it all

    @torch.no_grad()
    def evaluate(
        self, model: torch.nn.Module, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor
    ) -> dict[str, float]:
        return {"loss": self.context.flow_loss(model, batch, noise, sigmas, "none").mean().item()}
