"""Preference training: Diffusion-DPO carried to flow matching, on pairs of a preferred and a rejected result of
one prompt and control images (`train/objective=dpo`, settings `train.objective.*`).

Both results are noised with the same noise at the same noise level. The policy (the base with the trained
adapter) and a reference (the base with the adapter turned off, or with `train.objective.reference_lora` instead) each
predict both velocities; with e the per-sample velocity error (the batch's loss mask applied, so
`train.mask.source=edit` counts only the edit region of either result),

    z = -β/2 · ((e_policy(preferred) - e_ref(preferred)) - (e_policy(rejected) - e_ref(rejected)))
    loss = -log σ(z)  (+ sft_weight · e_policy(preferred))

z is the implicit reward margin: its mean and the share of pairs with z > 0 (ties count half) are logged as
`reward_margin` and `reward_accuracy`. Both passes run in the same step over one batch of both results; the
reference pass runs without a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from qie.errors import ConfigError
from qie.training.objectives import ObjectiveUse, StepMeans
from qie.training.objectives.flow_matching import FlowMatching
from qie.types import Batch

if TYPE_CHECKING:
    from qie.training.objectives.context import ObjectiveContext
# The largest settings taken: 500 times the default beta (z grows with it; a huge one turns the step's gradient into
# inf), and an SFT term 100 times the DPO loss's own weight.
BETA_MAX = 1e6
SFT_WEIGHT_MAX = 100.0


@dataclass(frozen=True)
class DpoSettings:
    """`train/objective=dpo`'s settings."""

    beta: float = 2000.0  # how sharply the margin is pushed; the errors are means over latent elements
    sft_weight: float = 0.0  # weight of the plain flow-matching loss on the preferred result
    reference_lora: str | None = None  # a LoRA file as the reference (else the base with the adapter off)

    def checked(self) -> DpoSettings:
        """These settings, checked.

        Raises:
            ConfigError: a beta out of (0, BETA_MAX] or an sft weight out of [0, SFT_WEIGHT_MAX] (NaN and inf
                included), a reference LoRA that is not a file.
        """
        if not 0 < self.beta <= BETA_MAX:  # NaN too
            raise ConfigError(
                f"train.objective.beta={self.beta} is out of range: give a value above 0 and at most {BETA_MAX:g} "
                "(e.g. 2000)"
            )
        if not 0 <= self.sft_weight <= SFT_WEIGHT_MAX:
            raise ConfigError(
                f"train.objective.sft_weight={self.sft_weight} is out of range: give a value from 0 to "
                f"{SFT_WEIGHT_MAX:g}"
            )
        if self.reference_lora and not Path(self.reference_lora).exists():
            raise ConfigError(
                f"train.objective.reference_lora={self.reference_lora!r} does not exist: give a LoRA file or "
                "folder, or leave it unset to use the base model as the reference"
            )
        return self


def paired(batch: Batch) -> Batch:
    """One batch of the preferred results, then the rejected ones: every other input repeated."""
    if "rejected" not in batch.fields:
        raise ValueError(f"batch {batch.ids} holds no rejected results: train/objective=dpo trains preference pairs")

    def twice(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.cat([t, t])

    return replace(
        batch,
        ids=[*batch.ids, *batch.ids],
        latents=torch.cat([batch.latents, batch.fields["rejected"]]),
        control_latents=[twice(c) for c in batch.control_latents],
        prompt_embeds=twice(batch.prompt_embeds),
        prompt_embeds_mask=twice(batch.prompt_embeds_mask),
        prompt_image_mask=twice(batch.prompt_image_mask),
        loss_mask=twice(batch.loss_mask),
        fields={},
    )


def margins(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> torch.Tensor:
    """The implicit reward margin z of each pair from the per-sample errors (preferred half, then rejected)."""
    won, lost = policy.float().chunk(2)
    ref_won, ref_lost = reference.float().chunk(2)
    return -0.5 * beta * ((won - ref_won) - (lost - ref_lost))


def accuracy(z: torch.Tensor) -> torch.Tensor:
    """The share of pairs whose preferred result the policy favours more than the reference does (ties half)."""
    return (z > 0).float().mean() + 0.5 * (z == 0).float().mean()


class Dpo(FlowMatching):
    """The Flow-DPO objective (see the module's text): the flow loss of each sample (`ObjectiveContext.flow_loss`)
    under the loss weighting over sigmas (`train.loss_weighting`), for the policy and the reference
    (`ObjectiveContext.reference`).

    Args:
        context: as `FlowMatching` takes it.
        beta, sft_weight, reference_lora: `DpoSettings`.
    """

    requires: ClassVar[frozenset[Any]] = FlowMatching.requires | {"rejected"}

    def __init__(
        self,
        context: ObjectiveContext,
        beta: float = 2000.0,
        sft_weight: float = 0.0,
        reference_lora: str | None = None,
    ) -> None:
        super().__init__(context)
        self.settings = DpoSettings(float(beta), float(sft_weight), reference_lora).checked()
        self.reference = context.reference(self.settings.reference_lora)
        self.means = StepMeans()

    @classmethod
    def use_problem(cls, use: ObjectiveUse) -> str | None:
        if not use.lora:
            return (
                "train/objective=dpo needs train.mode=lora: its reference is the base model with the adapter turned "
                "off (or train.objective.reference_lora), which training the whole transformer does not keep"
            )
        if use.family.outputs.layers:  # the output is an image's layers
            return (
                "train/objective=dpo does not train a layered model: a preference pair of layer stacks is not read; "
                "use train/objective=flow_matching"
            )
        if use.regularization:
            return (
                "train/objective=dpo does not mix in data.regularization (its samples are no preference pairs): "
                "remove data.regularization.path"
            )
        DpoSettings(
            **{k: use.options[k] for k in ("beta", "sft_weight", "reference_lora") if k in use.options}
        ).checked()
        return None

    def _terms(
        self, model: torch.nn.Module, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor, weighting: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, margins z, the policy's per-sample errors) of a batch of pairs at the given noise."""
        pairs, noise2, sigmas2 = paired(batch), torch.cat([noise, noise]), torch.cat([sigmas, sigmas])
        with torch.no_grad(), self.reference.active():
            reference = self.context.flow_loss(model, pairs, noise2, sigmas2, weighting)
        policy = self.context.flow_loss(model, pairs, noise2, sigmas2, weighting)
        z = margins(policy, reference, self.settings.beta)
        loss = -F.logsigmoid(z).mean()
        if self.settings.sft_weight:
            loss = loss + self.settings.sft_weight * policy.float().chunk(2)[0].mean()
        return loss, z.detach(), policy.detach()

    def loss(self, model: torch.nn.Module, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        noise, sigmas = self.context.noise_and_sigmas(batch, generator)
        loss, z, _ = self._terms(model, batch, noise, sigmas, self.context.loss_weighting)
        self.means.add(reward_accuracy=accuracy(z), reward_margin=z.mean())
        return loss

    def step_metrics(self) -> dict[str, float]:
        return self.means.pop()

    @torch.no_grad()
    def evaluate(
        self, model: torch.nn.Module, batch: Batch, noise: torch.Tensor, sigmas: torch.Tensor
    ) -> dict[str, float]:
        loss, z, _ = self._terms(model, batch, noise, sigmas, "none")
        return {"loss": float(loss), "reward_accuracy": float(accuracy(z)), "reward_margin": float(z.mean())}
