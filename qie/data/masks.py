"""Loss masks: a weight per target pixel, from a mask image or from where an edit changed its control image.

A mask is made at the training target's size (the same fit / crop as the target), then area-averaged to a
grid of `GRID` pixels per cell and stored in the cache (`loss_mask`), keyed by the bytes it is made from.
The training batch takes it area-averaged once more to the latent grid (8 or 16 pixels per latent pixel:
an average of averages of equal cells is the area average), so one entry serves every VAE.

- `file`: the sample's mask image (`masks/<stem>.png`, a manifest's `mask`, a data set column), as grey
  levels 0..1 (white: trained). A mask of another size than its target is first scaled to the target's; one of
  another shape (aspect ratio) is refused.
- `edit`: 1 where the target differs from its first control image by more than `threshold` (0..1, the largest
  channel difference), grown by `dilation` pixels; 0 elsewhere: an edit LoRA learns the change, not the
  unchanged background. For a preference pair, where either result (preferred or rejected) differs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from qie.cache.keys import FileHasher, entry_key
from qie.data.fields import field_named
from qie.data.images import ImageError, center_crop_to, fit_area, open_image, open_mask
from qie.data.samples import Sample

MASK_TYPE = "loss_mask"
SOURCES = ("none", "file", "edit")
GRID = 8  # pixels per stored mask cell: every VAE's latent pixel covers a whole number of cells


@dataclass(frozen=True)
class MaskSettings:
    """How masks are made (`data.mask`) at which target size (`data.target_pixels`, ...)."""

    source: str = "none"
    threshold: float = 0.05
    dilation: int = 16
    target_pixels: int = 1024 * 1024
    resize_mode: str = "resize"
    multiple_of: int = 32

    @property
    def on(self) -> bool:
        return self.source != "none"


def mask_key(sample: Sample, settings: MaskSettings, hasher: FileHasher) -> str | None:
    """The cache key of `sample`'s mask, or None when it has none (no target; no mask file; no control image to
    compare)."""
    if sample.target is None:
        return None
    fields: dict = {
        "source": settings.source,
        "target": hasher.hash(sample.target),
        "area": settings.target_pixels,
        "mode": settings.resize_mode,
        "multiple": settings.multiple_of,
        "grid": GRID,
    }
    if settings.source == "file" and sample.mask is not None:
        fields["mask"] = hasher.hash(sample.mask)
    elif settings.source == "edit" and sample.controls and sample.target is not None:
        fields |= {
            "control": hasher.hash(sample.controls[0]),
            "threshold": settings.threshold,
            "dilation": settings.dilation,
        }
        for name, result in _results(sample):  # none for most samples: their masks keep the keys they had
            fields[name] = hasher.hash(result)
    else:
        return None
    return entry_key(MASK_TYPE, fields)


def _results(sample: Sample) -> list[tuple[str, os.PathLike]]:
    """The images of `sample`'s fields that are other results of its edit (`SampleField.result`: a rejected one)."""
    return [(name, path) for name, path in sample.field_images if field_named(name).result]


def _like_target(img: Image.Image, size: tuple[int, int], settings: MaskSettings) -> Image.Image:
    """`img` (already at the target's own size) brought to the training size as `prepare_target` brings the
    target: fitted to the area (or covered and cropped)."""
    width, height = fit_area(size[0], size[1], settings.target_pixels, settings.multiple_of)
    if settings.resize_mode == "crop":
        return center_crop_to(img, width, height)
    return img.resize((width, height), Image.Resampling.BILINEAR)


def _grey(img: Image.Image, size: tuple[int, int], settings: MaskSettings) -> torch.Tensor:
    if img.size != size:
        img = img.resize(size, Image.Resampling.BILINEAR)
    return torch.from_numpy(np.asarray(_like_target(img, size, settings), dtype=np.float32) / 255.0)


def _pixels(img: Image.Image, size: tuple[int, int], settings: MaskSettings) -> torch.Tensor:
    """`img` brought to the target's own `size`, then to the training size: (H, W, C) float32 in [0, 1]."""
    if img.size != size:
        img = img.resize(size, Image.Resampling.BILINEAR)
    return torch.from_numpy(np.asarray(_like_target(img, size, settings), dtype=np.float32) / 255.0)


def make_mask(sample: Sample, settings: MaskSettings) -> torch.Tensor:
    """The mask of `sample` at the training target's size: (H, W) float32 in [0, 1].

    Raises:
        DataError: an unreadable image (naming it).
    """
    target = open_image(sample.target)
    size = target.size
    if settings.source == "file":
        mask = open_mask(sample.mask)
        if abs(mask.size[0] * size[1] - mask.size[1] * size[0]) > max(mask.size[1], size[1]):  # > a pixel's rounding
            raise ImageError(
                sample.mask,
                f"mask {str(sample.mask)!r} is {mask.size[0]}x{mask.size[1]}, its target "
                f"{size[0]}x{size[1]}: a mask must have its target's shape (at any scale)",
            )
        return _grey(mask, size, settings)
    # edit: where the target (or another result, a rejected one) differs from its control, at the target's size
    control = _pixels(open_image(sample.controls[0]), size, settings)
    results = [target] + [open_image(path) for _, path in _results(sample)]
    changed = torch.zeros(control.shape[:2])
    for result in results:
        changed = torch.maximum(
            changed, ((_pixels(result, size, settings) - control).abs().amax(dim=-1) > settings.threshold).float()
        )
    if settings.dilation > 0:
        r = settings.dilation
        changed = F.max_pool2d(changed[None, None], 2 * r + 1, stride=1, padding=r)[0, 0]
    return changed


def to_grid(mask: torch.Tensor, cell: int = GRID) -> torch.Tensor:
    """(H, W) mask -> (1, 1, H/cell, W/cell), each value the mean of its cell (ceil: a partial edge cell
    averages what it covers)."""
    h, w = -(-mask.shape[0] // cell), -(-mask.shape[1] // cell)
    return F.adaptive_avg_pool2d(mask[None, None].float(), (h, w))


def to_latent(grid: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """A stored (1, 1, gh, gw) mask area-averaged to the latent grid: (1, 1, h, w) (channel, frame, h, w)."""
    return F.adaptive_avg_pool2d(grid.float(), (h, w)) if grid.shape[-2:] != (h, w) else grid.float()


def weights(mask: torch.Tensor, outside_weight: float) -> torch.Tensor:
    """Loss weights of a mask in [0, 1]: 1 where it is white, `outside_weight` where it is black."""
    return outside_weight + (1.0 - outside_weight) * mask
