"""Edit-aware image metrics: did the edit change what it should, and keep the rest?

The edited region of a sample is where its target and control images differ. An output is compared with
the control image outside that region ("keep": the edit should leave it alone) and with the target inside
it ("edit": the edit should look like the target there). Both with PSNR and SSIM, restricted to the region
by averaging only its pixels.

- PSNR = 10·log10(1 / MSE) for images in [0, 1], MSE over the region's pixels and the 3 channels; capped at
  `PSNR_CAP` dB so identical images give a finite number that averages.
- SSIM as Wang et al. (2004): local means, variances and covariance under an 11×11 Gaussian window
  (σ = 1.5), C1 = (0.01)², C2 = (0.03)², computed per channel on the RGB values in [0, 1] (edges padded
  by reflection, so the map has the image's size), averaged over the channels and the region's pixels.
  The window of a pixel near the region's edge reaches over it; so that only the region's own pixels
  count, the output's pixels outside the region are replaced by the reference's before the map is made.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

PSNR_CAP = 100.0
# Target and control differ at a pixel when a channel differs by more than this (8 of 255 levels): above
# the noise of lossy compression, below any visible edit.
REGION_TOLERANCE = 8 / 255
_C1, _C2 = 0.01**2, 0.03**2


def to_tensor(image: Image.Image, size: tuple[int, int] | None = None) -> torch.Tensor:
    """(3, H, W) float64 in [0, 1] of an image, first resized to `size` (width, height) when given."""
    image = image.convert("RGB")
    if size is not None and image.size != tuple(size):
        image = image.resize(tuple(size), Image.Resampling.LANCZOS)
    return torch.from_numpy(np.asarray(image, dtype=np.float64) / 255.0).permute(2, 0, 1)


def edit_region(target: torch.Tensor, control: torch.Tensor, tolerance: float = REGION_TOLERANCE) -> torch.Tensor:
    """(H, W) bool: where any channel of `target` and `control` differs by more than `tolerance`."""
    return (target - control).abs().amax(dim=0) > tolerance


def psnr(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """PSNR in dB of images (3, H, W) in [0, 1] over the pixels of `mask` (all without one); nan for an
    empty mask; at most PSNR_CAP."""
    err = (a - b).pow(2).mean(dim=0)
    if mask is not None:
        if not mask.any():
            return math.nan
        err = err[mask]
    mse = float(err.mean())
    return PSNR_CAP if mse <= 10 ** (-PSNR_CAP / 10) else min(PSNR_CAP, 10 * math.log10(1.0 / mse))


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    g = g / g.sum()
    return torch.outer(g, g)


def ssim_map(a: torch.Tensor, b: torch.Tensor, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """(H, W) SSIM of images (3, H, W) in [0, 1], averaged over channels (see the module's docstring)."""
    size = min(window, *(d - 1 if d % 2 == 0 else d for d in a.shape[1:]))  # an odd window the image can hold
    kernel = _gaussian_window(size, sigma).expand(3, 1, size, size)
    pad = size // 2

    def blur(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x.unsqueeze(0), (pad, pad, pad, pad), mode="reflect") if pad else x.unsqueeze(0)
        return torch.nn.functional.conv2d(x, kernel, groups=3)[0]

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + _C1) * (2 * cov + _C2)) / ((mu_a**2 + mu_b**2 + _C1) * (var_a + var_b + _C2))
    return s.mean(dim=0)


def ssim(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Mean SSIM over the pixels of `mask` (all without one); nan for an empty mask."""
    values = ssim_map(a, b)
    if mask is not None:
        if not mask.any():
            return math.nan
        values = values[mask]
    return float(values.mean())


def edit_metrics(output: Image.Image, control: Image.Image, target: Image.Image) -> dict[str, float]:
    """PSNR and SSIM of `output` against `control` outside the edited region (`*_keep`) and against `target`
    inside it (`*_edit`), plus the region's share of the image (`edit_fraction`); control and target are
    resized to the output's size first. A metric whose region is empty is nan."""
    out = to_tensor(output)
    size = output.size
    ctrl, tgt = to_tensor(control, size), to_tensor(target, size)
    region = edit_region(tgt, ctrl)
    keep = ~region
    return {
        "psnr_keep": psnr(out, ctrl, keep),
        "ssim_keep": ssim(torch.where(region, ctrl, out), ctrl, keep),
        "psnr_edit": psnr(out, tgt, region),
        "ssim_edit": ssim(torch.where(keep, tgt, out), tgt, region),
        "edit_fraction": float(region.double().mean()),
    }
