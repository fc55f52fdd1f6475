"""Edit-aware validation metrics: PSNR and SSIM, over the whole image or a region, against exact values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from qie.evaluation.image_metrics import PSNR_CAP, edit_metrics, edit_region, psnr, ssim, ssim_map


def test_psnr_is_10_log10_of_one_over_the_mean_squared_error() -> None:
    a = torch.zeros(3, 8, 8, dtype=torch.float64)
    assert psnr(a, a + 0.1) == pytest.approx(20.0, abs=1e-9)  # MSE 0.01
    assert psnr(a, a) == PSNR_CAP
    b = a.clone()
    b[:, :4] = 0.5  # differs only in the top half
    top = torch.zeros(8, 8, dtype=torch.bool)
    top[:4] = True
    assert psnr(a, b, ~top) == PSNR_CAP and psnr(a, b, top) == pytest.approx(10 * math.log10(1 / 0.25))
    assert math.isnan(psnr(a, b, torch.zeros(8, 8, dtype=torch.bool)))


def test_ssim_of_constant_images_follows_the_formula() -> None:
    # Constant images have no variance: SSIM = (2ab + C1) / (a² + b² + C1) at every pixel.
    a, b = 0.2, 0.6
    expected = (2 * a * b + 0.01**2) / (a**2 + b**2 + 0.01**2)
    x, y = torch.full((3, 16, 16), a, dtype=torch.float64), torch.full((3, 16, 16), b, dtype=torch.float64)
    assert torch.allclose(ssim_map(x, y), torch.full((16, 16), expected, dtype=torch.float64), atol=1e-12)
    noise = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert ssim(noise, noise) == pytest.approx(1.0, abs=1e-12) and ssim(noise, 1 - noise) < 0


def test_edit_metrics_keep_outside_and_edit_inside_the_changed_region() -> None:
    rng = np.random.default_rng(0)
    control = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    target = control.copy()
    target[8:16, 8:16] = [255, 0, 0]  # the edit: a red square
    region = edit_region(
        torch.from_numpy(target / 255.0).permute(2, 0, 1), torch.from_numpy(control / 255.0).permute(2, 0, 1)
    )
    assert int(region.sum()) == 64
    perfect = edit_metrics(Image.fromarray(target), Image.fromarray(control), Image.fromarray(target))
    assert perfect["psnr_keep"] == perfect["psnr_edit"] == PSNR_CAP and perfect["edit_fraction"] == 64 / 1024
    assert perfect["ssim_edit"] == pytest.approx(1.0) and perfect["ssim_keep"] == pytest.approx(1.0)
    # An output that did nothing keeps everything and misses the edit.
    unchanged = edit_metrics(Image.fromarray(control), Image.fromarray(control), Image.fromarray(target))
    assert unchanged["psnr_keep"] == PSNR_CAP and unchanged["psnr_edit"] < 10
    # Control and target are resized to the output's size before comparing.
    small = edit_metrics(Image.fromarray(target).resize((16, 16)), Image.fromarray(control), Image.fromarray(target))
    assert set(small) == set(perfect) and all(math.isfinite(v) for v in small.values())
