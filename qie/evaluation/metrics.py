"""The built-in metrics, each a `Reward` (`qie.evaluation.reward`): the pixel error to the target, PSNR and SSIM
inside the edit region, and the change outside it. PSNR and SSIM are those of `qie.evaluation.image_metrics`
(validation's `psnr_edit`, `ssim_edit`): the same numbers in both places.

A score that has no pixels to measure (an empty edit region, or a sample without a control image for the change
outside the region) is nan; the eval stage's means leave nan out.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from qie.evaluation.image_metrics import psnr, ssim
from qie.evaluation.reward import Reward, control_at


class PixelError(Reward):
    """Mean absolute difference from the target, pixels and channels in [0, 1] (0: the target itself); lower is
    better."""

    needs: ClassVar[frozenset[str]] = frozenset({"target"})
    higher_is_better: ClassVar[bool] = False

    def __call__(
        self, images: torch.Tensor, controls: list[list[torch.Tensor]], prompts: list[str], **needed: Any
    ) -> torch.Tensor:
        targets = needed["targets"]
        return (images.double() - targets.double()).abs().flatten(1).mean(dim=1)


class EditPsnr(Reward):
    """PSNR (dB, at most `image_metrics.PSNR_CAP`) of the image against the target inside the edit region."""

    needs: ClassVar[frozenset[str]] = frozenset({"target", "mask"})
    nan_when_unmeasured: ClassVar[bool] = True  # an empty edit region

    def __call__(
        self, images: torch.Tensor, controls: list[list[torch.Tensor]], prompts: list[str], **needed: Any
    ) -> torch.Tensor:
        pairs = zip(images.double(), needed["targets"].double(), needed["masks"])
        return torch.tensor([psnr(out, tgt, region) for out, tgt, region in pairs], dtype=torch.float64)


class EditSsim(Reward):
    """SSIM of the image against the target inside the edit region (the window sees only the region's pixels of
    the image: outside it, the target's)."""

    needs: ClassVar[frozenset[str]] = frozenset({"target", "mask"})
    nan_when_unmeasured: ClassVar[bool] = True  # an empty edit region

    def __call__(
        self, images: torch.Tensor, controls: list[list[torch.Tensor]], prompts: list[str], **needed: Any
    ) -> torch.Tensor:
        scores = []
        for out, tgt, region in zip(images.double(), needed["targets"].double(), needed["masks"]):
            scores.append(ssim(torch.where(region, out, tgt), tgt, region))
        return torch.tensor(scores, dtype=torch.float64)


class OutsideChange(Reward):
    """Mean absolute difference from the (first) control image outside the edit region: what the edit changed
    that it should have kept; lower is better."""

    needs: ClassVar[frozenset[str]] = frozenset({"mask"})
    higher_is_better: ClassVar[bool] = False
    nan_when_unmeasured: ClassVar[bool] = True  # no control image, or an edit region that covers it all

    def __call__(
        self, images: torch.Tensor, controls: list[list[torch.Tensor]], prompts: list[str], **needed: Any
    ) -> torch.Tensor:
        scores = []
        for out, ctrl, region in zip(images.double(), controls, needed["masks"]):
            control, keep = control_at(ctrl, tuple(out.shape[-2:])), ~region
            if control is None or not keep.any():
                scores.append(math.nan)
                continue
            scores.append(float((out - control.double()).abs().mean(dim=0)[keep].mean()))
        return torch.tensor(scores, dtype=torch.float64)


__all__ = ["EditPsnr", "EditSsim", "OutsideChange", "PixelError"]
