"""What a family's sampler makes of one input, as a piece of the family (`ModelFamily.outputs`): one image per
sample (`IMAGES`) or the layers of one image (`LAYERS`).

The piece holds every rule that follows from the kind of output, so the stages call it without asking which
kind it is: how inference writes an input's outputs, where a batch row's outputs go, which built-in demo data
set the family's models train on, and whether layer counts apply (`predict.layers`, a training sample's layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def numbered(path: Path, count: int) -> list[Path]:
    """`out.png` for one image, `out_0.png, out_1.png, ...` for several."""
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}_{i}{path.suffix or '.png'}") for i in range(count)]


class Outputs:
    """The interface: what the stages need to know of a family's outputs.

    Attributes:
        layers: whether the output is the layers of one image (a capability: `predict.layers` sets how many, a
            training sample gives its ordered layers; a preference pair of layer stacks is not read).
    """

    layers: bool = False

    def write(self, images: Sequence[Any], path: Path, count: int) -> list[Path]:
        """Write one input's outputs (`count` = `predict.num_images` samples of it) at `path`; the files written."""
        raise NotImplementedError

    def row_path(self, name: Path) -> Path:
        """Where a batch row's outputs go, relative to `predict.output_dir`, for a row named `name` (its id)."""
        raise NotImplementedError

    def demo_data(self, spec: Any) -> str:
        """Which built-in demo data set (`qie.demo.builtin`) a model of `spec` trains on: "edit", "t2i", "layered"."""
        raise NotImplementedError

    def layers_problem(self, model: str, count: int) -> str | None:
        """Why a training sample with `count` layers cannot be used with model `model` (None: it can)."""
        raise NotImplementedError

    def option_problem(self, model: str, layers: int | None) -> str | None:
        """Why `predict.layers=layers` (None: unset) cannot be used with model `model` (None: it can)."""
        raise NotImplementedError


class ImageOutputs(Outputs):
    """One image per sample: `out.png`, or `out_0.png, out_1.png, ...` for several; a batch row's at `<id>.png`."""

    layers = False

    def write(self, images: Sequence[Any], path: Path, count: int) -> list[Path]:
        paths = numbered(path, len(images))
        for image, p in zip(images, paths):
            p.parent.mkdir(parents=True, exist_ok=True)
            image.save(p)
        return paths

    def row_path(self, name: Path) -> Path:
        return name.with_suffix(".png")

    def demo_data(self, spec: Any) -> str:
        return "edit" if spec.max_control_images > 0 else "t2i"

    def layers_problem(self, model: str, count: int) -> str | None:
        if count:
            return f"{count} layers, but model {model!r} makes one image: use a layered model or drop the layers"
        return None

    def option_problem(self, model: str, layers: int | None) -> str | None:
        if layers is not None:
            return f"predict.layers={layers}: model={model} makes one image, not layers; remove it"
        return None


class LayerOutputs(Outputs):
    """The layers of one image, in the pipeline's order: `folder/layer_0.png, layer_1.png, ...` (with several
    samples, `folder/<n>/layer_0.png, ...` for the n-th); a batch row's in the folder `<id>/`."""

    layers = True

    def write(self, images: Sequence[Any], path: Path, count: int) -> list[Path]:
        per = len(images) // count
        written = []
        for n in range(count):
            target = path if count == 1 else path / str(n)
            target.mkdir(parents=True, exist_ok=True)
            for i, image in enumerate(images[n * per : (n + 1) * per]):
                image.save(target / f"layer_{i}.png")
                written.append(target / f"layer_{i}.png")
        return written

    def row_path(self, name: Path) -> Path:
        return name

    def demo_data(self, spec: Any) -> str:
        return "layered"

    def layers_problem(self, model: str, count: int) -> str | None:
        if not count:
            return (
                f"no layers, but model {model!r} learns to split an image into layers: give each sample its "
                "ordered layers (manifest 'layers', layers/<stem>_<N>.png, or data.columns.layers)"
            )
        return None

    def option_problem(self, model: str, layers: int | None) -> str | None:
        if layers is not None and int(layers) < 1:
            return f"predict.layers={layers}: set it to 1 or more layers"
        return None


IMAGES = ImageOutputs()
LAYERS = LayerOutputs()

__all__ = ["IMAGES", "LAYERS", "ImageOutputs", "LayerOutputs", "Outputs", "numbered"]
