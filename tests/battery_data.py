"""A test-only synthetic data set for the family battery: a few solid shapes, deterministic, 64x64 px.

Independent of the demo's generator (`qie.demo.synthetic`) on purpose: the battery pins first losses on
these pictures, and those must not move when the demo's pictures change. What a family reads follows from
its `ModelSpec`: how many control images a sample may have (text to image: none; a fixed count: that many,
in the folder layout; a variable count: a mix of 2, 1 and none, in a manifest), and whether images keep
their alpha channel (RGBA targets with a transparent background, one RGBA reference).
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw

SIZE = 64
SAMPLES = 4
# (shape, fill colour, background) of each scene; a control shows the scene, its target the shape moved.
SCENES = [
    ("square", (220, 40, 40), (245, 245, 240)),
    ("circle", (40, 80, 220), (200, 200, 205)),
    ("triangle", (40, 180, 60), (30, 30, 40)),
    ("square", (235, 210, 40), (60, 20, 90)),
]
# A sample's second control image: a swatch of the colour the prompt asks for.
SWATCHES = [(0, 160, 160), (250, 120, 0), (130, 0, 200), (90, 90, 90)]
VARIABLE_COUNTS = (2, 1, 2, 0)


def shape_image(index: int, offset: int, alpha: bool = False, color: tuple[int, int, int] | None = None) -> Image.Image:
    """Scene `index`'s shape, its box moved `offset` px to the right (painted `color` instead of its own); an
    RGBA image with a transparent background when `alpha`."""
    shape, own, background = SCENES[index % len(SCENES)]
    color = color or own
    mode, fill, ground = ("RGBA", (*color, 255), (*background, 0)) if alpha else ("RGB", color, background)
    image = Image.new(mode, (SIZE, SIZE), ground)
    draw = ImageDraw.Draw(image)
    x0, y0 = 8 + offset, 12 + 4 * (index % 3)
    box = (x0, y0, x0 + 28, y0 + 28)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((box[0] + box[2]) // 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=fill)
    return image


def swatch_image(index: int) -> Image.Image:
    return Image.new("RGB", (SIZE, SIZE), SWATCHES[index % len(SWATCHES)])


def control_images(index: int, count: int, alpha: bool = False) -> list[Image.Image]:
    """Sample `index`'s `count` control images: the scene, then a colour swatch (RGBA when `alpha`)."""
    images = [shape_image(index, 0, alpha), swatch_image(index)][:count]
    return [im.convert("RGBA") for im in images] if alpha else images


def prompt(index: int, count: int) -> str:
    shape = SCENES[index % len(SCENES)][0]
    if count == 0:
        return f"a {shape} on a plain background, number {index}"
    if count == 1:
        return f"move the {shape} to the right, {index}"
    return f"move the {shape} of picture 1 to the right and paint it like picture 2, {index}"


def control_counts(spec) -> list[int]:
    """Control images per sample for a `qie.models.ModelSpec`."""
    if spec.max_control_images == 0:
        return [0] * SAMPLES
    if spec.min_control_images == spec.max_control_images:
        return [spec.min_control_images] * SAMPLES
    return [min(c, spec.max_control_images) for c in VARIABLE_COUNTS]


def write_dataset(root: Path, spec) -> Path:
    """Write the data set `spec`'s family reads under `root`; returns what `data.path` names."""
    if spec.family.outputs.layers:
        return _write_layered(root)
    counts, alpha = control_counts(spec), bool(spec.family.alpha)
    if len(set(counts)) == 1 and not alpha:
        return _write_folder(root, counts[0])
    return _write_manifest(root, counts, alpha)


def _write_folder(root: Path, count: int) -> Path:
    """training_images/ (+ control_images/ when `count`): the folder layout."""
    targets = root / "training_images"
    targets.mkdir(parents=True, exist_ok=True)
    for i in range(SAMPLES):
        shape_image(i, 24).save(targets / f"s{i}.png")
        (targets / f"s{i}.txt").write_text(prompt(i, count), encoding="utf-8")
        for k, image in enumerate(control_images(i, count)):
            controls = root / "control_images"
            controls.mkdir(exist_ok=True)
            image.save(controls / (f"s{i}.png" if k == 0 else f"s{i}_control_{k}.png"))
    return root


def _write_manifest(root: Path, counts: list[int], alpha: bool) -> Path:
    """A .jsonl manifest with images beside it."""
    (root / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, count in enumerate(counts):
        shape_image(i, 24, alpha).save(root / "img" / f"t{i}.png")
        controls = []
        for k, image in enumerate(control_images(i, count, alpha)):
            image.save(root / "img" / f"c{i}_{k}.png")
            controls.append(f"img/c{i}_{k}.png")
        rows.append({"id": f"s{i}", "target": f"img/t{i}.png", "controls": controls, "prompt": prompt(i, count)})
    manifest = root / "data.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return manifest


def _write_layered(root: Path) -> Path:
    """A layered manifest: each scene (RGBA) split into its background and its shape on transparency."""
    (root / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(SAMPLES):
        shape = shape_image(i, 0, alpha=True)
        ground = Image.new("RGBA", (SIZE, SIZE), (*SCENES[i % len(SCENES)][2], 255))
        Image.alpha_composite(ground, shape).save(root / "img" / f"in{i}.png")
        ground.save(root / "img" / f"in{i}_0.png")
        shape.save(root / "img" / f"in{i}_1.png")
        layers = [f"img/in{i}_0.png", f"img/in{i}_1.png"]
        rows.append({"id": f"s{i}", "image": f"img/in{i}.png", "layers": layers, "prompt": prompt(i, 0)})
    manifest = root / "data.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return manifest


def write_pairs(root: Path, spec) -> Path:
    """`write_dataset`, each sample a preference pair: its target preferred, the shape moved as well but painted
    the next scene's colour rejected (`rejected_images/` in the folder layout, `rejected` in a manifest)."""
    path = write_dataset(root, spec)
    alpha = bool(spec.family.alpha)
    wrong = [shape_image(i, 24, alpha, color=SCENES[(i + 1) % len(SCENES)][1]) for i in range(SAMPLES)]
    if path.is_dir():
        (path / "rejected_images").mkdir(exist_ok=True)
        for i, image in enumerate(wrong):
            image.save(path / "rejected_images" / f"s{i}.png")
        return path
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    for i, (row, image) in enumerate(zip(rows, wrong)):
        image.save(root / "img" / f"r{i}.png")
        row["rejected"] = f"img/r{i}.png"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def reference_images(root: Path, spec, count: int = 2) -> list[Path]:
    """Up to `count` control images `spec`'s model takes, written to `root` (for inference)."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, image in enumerate(control_images(1, min(count, spec.max_control_images), bool(spec.family.alpha))):
        image.save(root / f"ref{k}.png")
        paths.append(root / f"ref{k}.png")
    return paths
