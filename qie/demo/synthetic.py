"""A synthetic edit data set: coloured shapes on plain backgrounds, with recolour instructions.

Each sample's control image shows one shape; the target shows the same shape in another colour, and
the caption says which ("make the circle red"). Written in the folder layout, with a held-out split.
"""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 210, 40),
    "purple": (150, 60, 190),
}
BACKGROUNDS = [(245, 245, 240), (200, 200, 205), (30, 30, 40)]
SHAPES = ("circle", "square", "triangle")


def draw_shape(size: int, shape: str, color: tuple, background: tuple, box: tuple[int, int, int, int]) -> Image.Image:
    img = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(img)
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=color)
    return img


def write_split(root: Path, count: int, size: int, rng: random.Random) -> None:
    (root / "training_images").mkdir(parents=True, exist_ok=True)
    (root / "control_images").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        shape = rng.choice(SHAPES)
        src, dst = rng.sample(sorted(COLORS), 2)
        background = rng.choice(BACKGROUNDS)
        side = rng.randint(size // 3, size // 2)
        x, y = rng.randint(2, size - side - 2), rng.randint(2, size - side - 2)
        box = (x, y, x + side, y + side)
        stem = f"{i:05d}"
        draw_shape(size, shape, COLORS[src], background, box).save(root / "control_images" / f"{stem}.png")
        draw_shape(size, shape, COLORS[dst], background, box).save(root / "training_images" / f"{stem}.png")
        (root / "training_images" / f"{stem}.txt").write_text(f"make the {shape} {dst}\n", encoding="utf-8")


def make_dataset(root: str | Path, train: int = 32, heldout: int = 8, size: int = 64, seed: int = 0) -> Path:
    """Write `root/train` and `root/heldout` in the folder layout; returns `root`. Same seed, same files."""
    root = Path(root)
    rng = random.Random(seed)
    write_split(root / "train", train, size, rng)
    write_split(root / "heldout", heldout, size, rng)
    return root
