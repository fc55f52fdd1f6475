"""Image reading and the resizing rules of Qwen-Image-Edit's pipelines.

Sizes follow diffusers: an image is resized to a target *area* keeping its aspect ratio, sides rounded
to a multiple of 32 (`calculate_dimensions`), and normalised to [-1, 1] by diffusers' VaeImageProcessor.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from qie.errors import DataError


class ImageError(DataError):
    """An image file that cannot be used; `path` names it."""

    def __init__(self, path: str | Path, message: str) -> None:
        super().__init__(message)
        self.path = str(path)


def open_mask(path: str | Path) -> Image.Image:
    """Read a mask image as 8-bit grey ("L"), upright like the images it masks (EXIF orientation applied).

    Raises:
        ImageError: naming the file when it is missing or not a readable image.
    """
    try:
        with Image.open(path) as img:
            img.load()
            return ImageOps.exif_transpose(img).convert("L")
    except FileNotFoundError:
        raise ImageError(path, f"mask {str(path)!r} does not exist") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(
            path, f"mask {str(path)!r} cannot be read ({e}): give a grey or black-and-white image"
        ) from None


def open_image(path: str | Path, alpha: bool = False) -> Image.Image:
    """Read an image as 8-bit RGB (or RGBA with `alpha`), upright (EXIF orientation applied).

    Without `alpha`, alpha (RGBA, LA, palette or grey with a transparent colour) is composited on white;
    with it, alpha is kept and an image without one is opaque. Palette, grey, CMYK, 16-bit and 32-bit
    images are converted, never rejected.

    Raises:
        ImageError: naming the file when it is missing or not a readable image.
    """
    try:
        with Image.open(path) as img:
            img.load()
            upright = ImageOps.exif_transpose(img)
            return to_rgba(upright) if alpha else to_rgb(upright)
    except FileNotFoundError:
        raise ImageError(path, f"image {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ImageError(path, f"image {str(path)!r} is a folder, not an image file") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(path, f"image {str(path)!r} cannot be read ({e}): replace or remove it") from None


# EXIF orientations (tag 0x0112) that turn the image a quarter: its upright width is the stored height.
_QUARTER_TURNS = {5, 6, 7, 8}


def upright_size(path: str | Path) -> tuple[int, int]:
    """(width, height) of the image as `open_image` gives it (EXIF orientation applied), from its header only.

    Raises:
        ImageError: naming the file when it is missing or not a readable image.
    """
    try:
        with Image.open(path) as img:
            turned = img.getexif().get(0x0112) in _QUARTER_TURNS
            return (img.height, img.width) if turned else (img.width, img.height)
    except FileNotFoundError:
        raise ImageError(path, f"image {str(path)!r} does not exist") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(path, f"image {str(path)!r} cannot be read ({e}): replace or remove it") from None


def as_image(image: Image.Image | np.ndarray | str | Path, alpha: bool = False) -> Image.Image:
    """An input image as 8-bit RGB: a PIL image, a file path, or a numpy array of shape (H, W), (H, W, 3)
    or (H, W, 4), either uint8 (0..255) or float in [0, 1] (alpha, as for files, is composited on white;
    with `alpha` the image is RGBA instead, its alpha kept).

    Raises:
        ImageError: a missing or unreadable file, or an array of another shape, type or range.
    """
    convert = to_rgba if alpha else to_rgb
    if isinstance(image, Image.Image):
        return convert(image)
    if isinstance(image, np.ndarray):
        return convert(_array_image(image))
    if isinstance(image, (str, Path)):
        return open_image(image, alpha)
    raise ImageError(
        str(type(image)), f"an image must be a PIL image, a numpy array or a path, got {type(image).__name__}"
    )


def _array_image(array: np.ndarray) -> Image.Image:
    where = f"array of shape {array.shape} and dtype {array.dtype}"
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (1, 3, 4)) or 0 in array.shape:
        raise ImageError("array", f"image {where}: expected (H, W), (H, W, 3) or (H, W, 4), channels last")
    if array.dtype == np.uint8:
        pixels = array
    elif np.issubdtype(array.dtype, np.floating):
        low, high = float(np.nanmin(array)), float(np.nanmax(array))
        if not (np.isfinite(array).all() and low >= 0.0 and high <= 1.0):
            raise ImageError("array", f"image {where} spans [{low}, {high}]: float images must lie in [0, 1]")
        pixels = np.round(array * 255.0).astype(np.uint8)
    else:
        raise ImageError("array", f"image {where}: use uint8 (0..255) or float in [0, 1]")
    if pixels.ndim == 3 and pixels.shape[2] == 1:
        pixels = pixels[:, :, 0]
    return Image.fromarray(np.ascontiguousarray(pixels))  # L, RGB or RGBA by shape


def to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB of any PIL mode: alpha over white, 16/32-bit and float scaled to 0..255."""
    if img.mode.startswith("I") or img.mode == "F":
        img = _high_depth_to_l(img)
    if img.mode in ("P", "L", "RGB") and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = img.convert("RGBA") if img.mode != "La" else img.convert("LA").convert("RGBA")
        background = Image.new("RGB", img.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return img.convert("RGB")


def to_rgba(img: Image.Image) -> Image.Image:
    """8-bit RGBA of any PIL mode: alpha kept (a transparent palette or grey colour becomes alpha 0),
    opaque where the image has none; 16/32-bit and float scaled to 0..255."""
    if img.mode.startswith("I") or img.mode == "F":
        img = _high_depth_to_l(img)
    if img.mode in ("CMYK", "YCbCr", "LAB", "HSV"):
        img = img.convert("RGB")
    if img.mode == "La":
        img = img.convert("LA")
    return img if img.mode == "RGBA" else img.convert("RGBA")


def _high_depth_to_l(img: Image.Image) -> Image.Image:
    """Greyscale of a 16-bit ("I;16*"), 32-bit ("I") or float ("F") image, scaled to 8 bits.

    16-bit images span 0..65535; "I" images are taken as 8-bit values if none exceeds 255 (PIL opens some
    8-bit files as "I"), else as 16-bit; "F" images as 0..1 if none exceeds 1, else as 0..255.
    """
    arr = np.asarray(img, dtype=np.float64)
    top = float(arr.max()) if arr.size else 0.0
    if img.mode.startswith("I;16"):
        peak = 65535.0
    elif img.mode == "F":
        peak = 1.0 if top <= 1.0 else 255.0
    else:
        peak = 255.0 if top <= 255 else 65535.0
    return Image.fromarray(np.clip(np.floor(arr / peak * 255.0 + 0.5), 0, 255).astype(np.uint8), "L")


def fit_area(width: int, height: int, area: int, multiple: int = 32) -> tuple[int, int]:
    """(width, height) of about `area` pixels with the aspect ratio of width/height, as diffusers rounds."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    h = w / ratio
    return max(multiple, round(w / multiple) * multiple), max(multiple, round(h / multiple) * multiple)


@lru_cache(maxsize=4)
def _processor(vae_scale_factor: int):
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(vae_scale_factor=vae_scale_factor)


def to_tensor(img: Image.Image, width: int, height: int, multiple: int = 16) -> torch.Tensor:
    """Resize to (width, height) and normalise to a (3, H, W) float32 tensor in [-1, 1]."""
    return _processor(multiple).preprocess(img, height, width)[0]


def resize(img: Image.Image, width: int, height: int, multiple: int = 16) -> Image.Image:
    return _processor(multiple).resize(img, height, width)


def center_crop_to(img: Image.Image, width: int, height: int) -> Image.Image:
    """Scale to cover (width, height), then cut the middle: keeps aspect, loses the borders."""
    scale = max(width / img.width, height / img.height)
    w, h = max(width, round(img.width * scale)), max(height, round(img.height * scale))
    img = img.resize((w, h), Image.Resampling.LANCZOS)
    left, top = (w - width) // 2, (h - height) // 2
    return img.crop((left, top, left + width, top + height))


def prepare_target(img: Image.Image, area: int, mode: str = "resize", multiple: int = 32) -> torch.Tensor:
    """The training target: about `area` pixels, sides a multiple of `multiple`, in [-1, 1]."""
    width, height = fit_area(img.width, img.height, area, multiple)
    if mode == "crop":
        img = center_crop_to(img, width, height)
    return to_tensor(img, width, height)


def condition_images(img: Image.Image, vae_pixels: int, vl_pixels: int) -> tuple[torch.Tensor, Image.Image]:
    """What the pipelines make of one control image: the VAE input (3, H, W) and the image Qwen2.5-VL sees."""
    vae_w, vae_h = fit_area(img.width, img.height, vae_pixels)
    vl_w, vl_h = fit_area(img.width, img.height, vl_pixels)
    return to_tensor(img, vae_w, vae_h), resize(img, vl_w, vl_h)


def rgb(images: torch.Tensor) -> torch.Tensor:
    """Images [..., C, H, W] in [0, 1] as rewards take them, three channels: an RGBA image (a family that edits with
    transparency) composited on white, as its pipeline shows it to the text encoder."""
    if images.shape[-3] != 4:
        return images
    colour, alpha = images[..., :3, :, :], images[..., 3:, :, :]
    return colour * alpha + (1 - alpha)
