"""An objective written outside qie that computes what it trains against ahead of training, into a store of its own
entry type: the base model's velocity for each sample at one fixed noise and noise level (`prior_velocity`). Training
is flow matching plus `prior_weight` times the distance of the model's velocity there from the base's, which keeps
the LoRA near the base where the data says nothing. Precompute fills the store (`precompute.teachers=true`), cached
training reads it, and `prior_computed` logs the share of the step's entries that had to be computed."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

import torch

from qie.extend import Batch, FlowMatching, ObjectiveContext, StepMeans

ENTRY_TYPE = "prior_velocity"
SIGMA, SEED = 0.5, 0


def digest(*tensors: torch.Tensor | None) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(str(tuple(t.shape)).encode() + t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class PriorTarget(FlowMatching):
    """Flow matching plus `prior_weight` times the squared distance to the base model's stored velocity."""

    def __init__(self, context: ObjectiveContext, prior_weight: float = 0.5, **kwargs: Any) -> None:
        super().__init__(context, **kwargs)
        self.prior_weight = prior_weight
        self.store = context.store(ENTRY_TYPE)
        self.reference = context.reference()  # the base: the trained adapter turned off
        self.means = StepMeans()

    def _inputs(self, batch: Batch, i: int) -> tuple[Batch, torch.Tensor, torch.Tensor, dict]:
        one = batch.take([i])
        noise = torch.randn(one.latents.shape, generator=torch.Generator().manual_seed(SEED)).to(one.latents)
        sigmas = torch.full((1,), SIGMA, device=one.latents.device)
        inputs = digest(one.latents, one.prompt_embeds, one.prompt_embeds_mask, *one.control_latents)
        return one, noise, sigmas, {"model": dict(self.context.model_key), "inputs": inputs, "sigma": SIGMA}

    def prior(self, model: torch.nn.Module, batch: Batch, i: int) -> tuple[torch.Tensor, bool]:
        """Sample `i`'s stored base velocity (computed and written where missing and the store fills)."""
        one, noise, sigmas, fields = self._inputs(batch, i)
        found = self.store.read(fields)
        if found is not None:
            return found.to(noise.device), False
        with torch.no_grad(), self.reference.active():
            velocity = self.context.flow_prediction(model, one, noise, sigmas).prediction[0].float()
        if self.store.fills:
            self.store.write(fields, velocity)
        return velocity, True

    def fill(self, model: torch.nn.Module, batch: Batch) -> int:
        return sum(self.prior(model, batch, i)[1] for i in range(len(batch.ids)))

    def fills_per_sample(self) -> int:
        return 1

    def loss(self, model: torch.nn.Module, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        distances, computed = [], 0
        for i in range(len(batch.ids)):
            velocity, fresh = self.prior(model, batch, i)
            one, noise, sigmas, _ = self._inputs(batch, i)
            out = self.context.flow_prediction(model, one, noise, sigmas)
            distances.append(replace(out, target=velocity[None]).error())  # to the base's velocity, not the data's
            computed += fresh
        self.means.add(prior_computed=computed / len(batch.ids))
        return super().loss(model, batch, generator) + self.prior_weight * torch.cat(distances).mean()

    def step_metrics(self) -> dict[str, float]:
        return self.means.pop()
