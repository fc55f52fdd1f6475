"""Reward-ranked fine-tuning written outside qie: each step samples `copies` edits of every sample with the model
itself (few steps, from the cached embeddings), scores them with a reward, and trains flow matching on the best
one. Rows need no target."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from qie.extend import Batch, FlowMatching, ObjectiveContext, StepMeans


class BestOfN(FlowMatching):
    """Flow matching on the best of `copies` own samples of each row, by `reward`."""

    requires = frozenset()  # no target: the model's own best edit is what it trains on

    def __init__(self, context: ObjectiveContext, reward: Any = None, copies: int = 4, steps: int = 4) -> None:
        super().__init__(context)
        self.reward, self.copies, self.steps = context.reward(reward), copies, steps
        self.means = StepMeans()

    def loss(self, model: torch.nn.Module, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        n = self.copies
        with torch.no_grad():
            latents = self.context.sample(model, batch, generator, steps=self.steps, copies=n)
            images = self.context.decode(latents)
            controls, prompts = self.context.reward_inputs(batch, copies=n)
            scores = torch.as_tensor(self.reward(images, controls, prompts)).reshape(-1, n)
        best = scores.argmax(1)
        chosen = latents.reshape(-1, n, *latents.shape[1:])[torch.arange(len(best)), best]
        self.means.add(reward_mean=scores.mean(), reward_best=scores.max(1).values.mean())
        return super().loss(model, replace(batch, latents=chosen.to(batch.latents)), generator)

    def step_metrics(self) -> dict[str, float]:
        return self.means.pop()
