"""A reward written outside qie: how strongly an edit holds one colour (the closeness of its mean colour to `rgb`)."""

from __future__ import annotations

from typing import Any

import torch

from qie.extend import Reward


class Colour(Reward):
    """1 minus the mean absolute difference of the image's mean colour from `rgb` (0-255 per channel)."""

    def __init__(self, rgb: tuple[int, int, int] = (255, 0, 0)) -> None:
        self.rgb = torch.tensor([float(c) / 255 for c in rgb])

    def __call__(
        self, images: torch.Tensor, controls: list[list[torch.Tensor]], prompts: list[str], **needed: Any
    ) -> torch.Tensor:
        means = images.float().mean(dim=(2, 3))
        return 1 - (means - self.rgb).abs().mean(dim=1)

    def describe(self) -> dict[str, Any]:
        return {"rgb": [round(float(c) * 255) for c in self.rgb]}


class Constant(Reward):
    """A broken reward: the same score for every edit, whatever it shows."""

    def __call__(
        self, images: torch.Tensor, controls: list[list[torch.Tensor]], prompts: list[str], **needed: Any
    ) -> torch.Tensor:
        return torch.full((images.shape[0],), 0.5)
