"""A synthetic data set: coloured shapes on plain backgrounds, with recolour instructions.

Each sample's control image shows one shape; the target shows the same shape in another colour, and
the caption says which ("make the circle red"). For a text-to-image model there is no control image and the
caption describes the target ("a red circle"). For a layered model each sample is an image of one to three
shapes and its layers: the background, then each shape on its own transparent layer, back to front; the caption
describes the scene ("a red circle, then a blue square on a dark background"). Written in the folder layouts,
with a held-out split. Shapes are large and the colours few and far apart, so that a tiny model's edit is plain
to see.
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
BACKGROUND_NAMES = {(245, 245, 240): "white", (200, 200, 205): "grey", (30, 30, 40): "dark"}
SHAPES = ("circle", "square", "triangle")
# The shape's side, as a fraction of the image side.
SIDE_RANGE = (0.4, 0.7)
# A layered sample: how many shapes (each one layer over the background layer), and their sides.
SHAPES_PER_IMAGE = (1, 3)
LAYER_SIDE_RANGE = (0.3, 0.55)


def draw_shape(size: int, shape: str, color: tuple, background: tuple, box: tuple[int, int, int, int]) -> Image.Image:
    """The shape filled with `color` on `background` (RGB; RGBA when both have four channels). No anti-aliasing:
    every pixel is the shape's colour or the background's."""
    img = Image.new("RGBA" if len(background) == 4 else "RGB", (size, size), background)
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


def random_layers(rng: random.Random, size: int) -> tuple[Image.Image, list[Image.Image], str]:
    """One layered sample: (image, layers, caption). The layers are RGBA, back to front: the opaque background,
    then each shape alone (alpha 0 outside it); the image is their alpha composite, opaque."""
    background = rng.choice(BACKGROUNDS)
    layers = [Image.new("RGBA", (size, size), (*background, 255))]
    named = []
    for _ in range(rng.randint(*SHAPES_PER_IMAGE)):
        shape, color = rng.choice(SHAPES), rng.choice(sorted(COLORS))
        side = rng.randint(int(size * LAYER_SIDE_RANGE[0]), int(size * LAYER_SIDE_RANGE[1]))
        x, y = rng.randint(2, size - side - 2), rng.randint(2, size - side - 2)
        layers.append(draw_shape(size, shape, (*COLORS[color], 255), (0, 0, 0, 0), (x, y, x + side, y + side)))
        named.append(f"a {color} {shape}")
    image = composite(layers)
    return image, layers, f"{', then '.join(named)} on a {BACKGROUND_NAMES[background]} background"


def composite(layers: list[Image.Image]) -> Image.Image:
    """RGBA layers, back to front, alpha-composited into one RGBA image."""
    out = layers[0].convert("RGBA")
    for layer in layers[1:]:
        out = Image.alpha_composite(out, layer.convert("RGBA"))
    return out


def write_layered_split(root: Path, count: int, size: int, rng: random.Random) -> None:
    """`images/<stem>.png` + `<stem>.txt` and `layers/<stem>_<N>.png`, N = 0 (the background) upwards."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "layers").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        image, layers, caption = random_layers(rng, size)
        stem = f"{i:05d}"
        image.save(root / "images" / f"{stem}.png")
        (root / "images" / f"{stem}.txt").write_text(caption + "\n", encoding="utf-8")
        for n, layer in enumerate(layers):
            layer.save(root / "layers" / f"{stem}_{n}.png")


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
    root: str | Path,
    train: int = 32,
    heldout: int = 8,
    size: int = 64,
    seed: int = 0,
    controls: bool = True,
    layered: bool = False,
) -> Path:
    """Write `root/train` and `root/heldout` in the folder layout (without control images when not `controls`;
    images and their layers when `layered`); returns `root`. Same seed, same files."""
    root = Path(root)
    rng = random.Random(seed)
    for split, count in (("train", train), ("heldout", heldout)):
        if layered:
            write_layered_split(root / split, count, size, rng)
        else:
            write_split(root / split, count, size, rng, controls)
    return root
