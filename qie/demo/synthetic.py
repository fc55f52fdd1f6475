"""A synthetic data set: coloured shapes on plain backgrounds, with recolour instructions.

Each sample's control image shows one shape; the target shows the same shape in another colour, and
the caption says which ("make the circle red"). For a text-to-image model there is no control image and the
caption describes the target ("a red circle"). Written in the folder layout, with a held-out split.
Shapes are large and the colours few and far apart, so that a tiny model's edit is plain to see.
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
}
BACKGROUNDS = [(245, 245, 240), (200, 200, 205), (30, 30, 40)]
SHAPES = ("circle", "square", "triangle")
# The shape's side, as a fraction of the image side.
SIDE_RANGE = (0.4, 0.7)


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


def random_scene(rng: random.Random, size: int) -> tuple[str, tuple, tuple[int, int, int, int]]:
    """A shape, a background and a box for it, drawn from `rng`."""
    shape = rng.choice(SHAPES)
    background = rng.choice(BACKGROUNDS)
    side = rng.randint(int(size * SIDE_RANGE[0]), int(size * SIDE_RANGE[1]))
    x, y = rng.randint(2, size - side - 2), rng.randint(2, size - side - 2)
    return shape, background, (x, y, x + side, y + side)


def random_edit(rng: random.Random, size: int) -> tuple[Image.Image, Image.Image, str]:
    """One sample: (control image, target image, instruction)."""
    shape, background, box = random_scene(rng, size)
    src, dst = rng.sample(sorted(COLORS), 2)
    control = draw_shape(size, shape, COLORS[src], background, box)
    return control, draw_shape(size, shape, COLORS[dst], background, box), f"make the {shape} {dst}"


def random_image(rng: random.Random, size: int) -> Image.Image:
    """One image as the data set's images are drawn (for training the demo's VAE)."""
    shape, background, box = random_scene(rng, size)
    return draw_shape(size, shape, COLORS[rng.choice(sorted(COLORS))], background, box)


def write_split(root: Path, count: int, size: int, rng: random.Random, controls: bool = True) -> None:
    (root / "training_images").mkdir(parents=True, exist_ok=True)
    if controls:
        (root / "control_images").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        control, target, prompt = random_edit(rng, size)
        stem = f"{i:05d}"
        if controls:
            control.save(root / "control_images" / f"{stem}.png")
        else:  # "make the circle red" -> "a red circle"
            shape, color = prompt.split()[-2:]
            prompt = f"a {color} {shape}"
        target.save(root / "training_images" / f"{stem}.png")
        (root / "training_images" / f"{stem}.txt").write_text(prompt + "\n", encoding="utf-8")


def make_dataset(
    root: str | Path, train: int = 32, heldout: int = 8, size: int = 64, seed: int = 0, controls: bool = True
) -> Path:
    """Write `root/train` and `root/heldout` in the folder layout (without control images when not `controls`);
    returns `root`. Same seed, same files."""
    root = Path(root)
    rng = random.Random(seed)
    write_split(root / "train", train, size, rng, controls)
    write_split(root / "heldout", heldout, size, rng, controls)
    return root
