"""A reward for the demo's recolour task (`qie.demo.synthetic`) that reads only the instruction and the control
image, so that online RL (`train/objective=grpo`) can train on its rows without targets.

The shape is where the control differs from its background (the corners' colour); the edit should hold the
instruction's colour there ("make the circle red") and the control's pixels elsewhere. The score is

    1 - (colour_weight * |edit - named colour| inside + (1 - colour_weight) * |edit - control| outside)

with each term a mean absolute difference in [0, 1] over its pixels and channels: 1 is the perfect edit.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from qie.demo.synthetic import COLORS
from qie.evaluation.reward import Reward, control_at

# How far (mean absolute difference over channels, in [0, 1]) a pixel is from the background to be the shape's.
SHAPE_THRESHOLD = 0.1


def named_colour(prompt: str) -> torch.Tensor | None:
    """The RGB (3,) in [0, 1] of the last of the demo's colour names in `prompt`, or None."""
    words = [w.strip(".,!").lower() for w in prompt.split()]
    named = [w for w in words if w in COLORS]
    return torch.tensor(COLORS[named[-1]], dtype=torch.float64) / 255 if named else None


def shape_region(control: torch.Tensor) -> torch.Tensor:
    """(H, W) bool: where the control (3, H, W) differs from its background, the median of its four corners."""
    corners = torch.stack([control[:, 0, 0], control[:, 0, -1], control[:, -1, 0], control[:, -1, -1]], 1)
    background = corners.median(dim=1).values
    return (control - background[:, None, None]).abs().mean(0) > SHAPE_THRESHOLD


class RecolourReward(Reward):
    """The demo's recolour reward (see the module's text); higher is better, 1 at most."""

    nan_when_unmeasured: ClassVar[bool] = True  # no control image, or a prompt naming no colour

    def __init__(self, colour_weight: float = 0.5) -> None:
        if not 0 <= colour_weight <= 1:
            raise ValueError(f"colour_weight={colour_weight} is out of range: give a value from 0 to 1")
        self.colour_weight = float(colour_weight)

    def __call__(
        self, images: torch.Tensor, controls: list[list[torch.Tensor]], prompts: list[str], **needed: Any
    ) -> torch.Tensor:
        scores = []
        for image, ctrl, prompt in zip(images.double(), controls, prompts):
            control, colour = control_at(ctrl, tuple(image.shape[-2:])), named_colour(prompt)
            if control is None or colour is None:
                scores.append(float("nan"))
                continue
            control = control.double()
            inside = shape_region(control)
            error = (image - colour[:, None, None]).abs().mean(0)
            kept = (image - control).abs().mean(0)
            colour_term = error[inside].mean() if inside.any() else torch.tensor(0.0, dtype=torch.float64)
            keep_term = kept[~inside].mean() if (~inside).any() else torch.tensor(0.0, dtype=torch.float64)
            w = self.colour_weight
            scores.append(float(1 - (w * colour_term + (1 - w) * keep_term)))
        return torch.tensor(scores, dtype=torch.float64)

    def describe(self) -> dict[str, Any]:
        return {"colour_weight": self.colour_weight, "threshold": SHAPE_THRESHOLD}


__all__ = ["RecolourReward", "named_colour", "shape_region"]
