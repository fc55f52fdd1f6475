"""An objective and an image field written outside qie, as docs/extending.md shows them: flow matching on the target
plus `depth_weight` times flow matching on each sample's depth map (`SampleField("depth")`), its mean logged as
`depth_loss`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from qie.extend import Batch, FlowMatching, SampleField

DEPTH = SampleField("depth", kind="image")


class DepthAware(FlowMatching):
    """Flow matching on the target, plus `depth_weight` times flow matching on the depth map."""

    requires = FlowMatching.requires | {DEPTH}

    def __init__(self, *args: Any, depth_weight: float = 0.1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.depth_weight = depth_weight
        self.depth_losses: list[float] = []

    def loss(self, model: torch.nn.Module, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        depth = super().loss(model, replace(batch, latents=batch.fields["depth"]), generator)
        self.depth_losses.append(float(depth.detach()))
        return super().loss(model, batch, generator) + self.depth_weight * depth

    def step_metrics(self) -> dict[str, float]:
        out = {"depth_loss": sum(self.depth_losses) / len(self.depth_losses)} if self.depth_losses else {}
        self.depth_losses = []
        return out
