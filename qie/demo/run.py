"""The demo: generate a synthetic edit data set, precompute, train a LoRA from the cache, edit the held-out
images with the base model and with the LoRA, and show and measure the difference.

It writes `demo.png` (one row per held-out sample: control, target, base output, LoRA output, the prompt
under it), logs the same picture to TensorBoard, and writes `demo_report.json`: held-out loss before and
after, the VAE's reconstruction PSNR on the held-out targets, and the pixel error of the base and LoRA
outputs against the targets. It says the LoRA learned only when the held-out loss fell by
REQUIRED_LOSS_DROP and the pixel error by REQUIRED_PIXEL_DROP.

The data set is of the kind the model takes (`qie.demo.builtin.data_kind`, its family's outputs say which), and
`OUTPUTS` says how the demo predicts and measures that kind's outputs. For a model that splits an image into layers
the data set is the layered one (an image of shapes and its layers, `qie.demo.synthetic`), and each held-out image
is split into as many layers as its sample has (`predict.layers`). Each layer is measured twice, per layer and over
all of them: the latent error (the sampled layer's normalised latent against the encoded target layer) and the pixel
error (premultiplied RGBA: a transparent pixel's colour does not count). The verdict takes the latent error in place
of the pixel error: decoded layers are only as good as the VAE (a tiny model's is untrained; the Layered demo's model
ships a trained one, so its pixel error moves too). Its picture has three rows per sample
(the image and its layers, the base model's, the LoRA's), each starting with the composite of its layers, layers on
a checkerboard where they are transparent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from PIL import Image

from qie.checks import Checked, check
from qie.components import prepare_model
from qie.config.cache import PrecomputeConfig
from qie.data.images import open_image, prepare_target
from qie.data.samples import Sample
from qie.data.scan import scan_dataset
from qie.demo.builtin import data_kind
from qie.demo.measure import by_position, frame_errors, layer_error, mean_of_all, pixel_error, vae_psnr
from qie.demo.page import write_demo_page
from qie.demo.share import export_demo
from qie.demo.summary import REQUIRED_LOSS_DROP, REQUIRED_PIXEL_DROP, format_report
from qie.demo.synthetic import composite, make_dataset
from qie.evaluation.grid import captioned_grid
from qie.models import ModelSpec
from qie.models.sampling import SamplingOptions
from qie.stages import infer, precompute, train
from qie.stages.edge import Edge
from qie.stages.recipe import Recipe
from qie.stages.settings import sampling_options
from qie.training.evaluate import heldout_loss
from qie.training.logging import MetricsLogger

COLUMNS = ("control", "target", "base model", "LoRA")
# A layered model's picture: the composite, then one column per layer (as many as the samples' most).
LAYERED_COLUMNS = ("image",)
TILE = 128
GRID_TAG = "demo/heldout"


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Run the demo in `run_dir` (from code: `cfg` checked once, `qie.checks.check`, then `start`); returns the report
    also written to `run_dir/demo_report.json`."""
    return start(check(cfg), run_dir)


def start(checked: Checked, run_dir: Path) -> dict:
    """The demo's edge: the checked config handed to the `DemoRecipe`, which runs the precompute and train stages on
    typed groups made of it (each stage's `start`). See `run`."""
    return DemoRecipe(checked, Path(run_dir)).execute()


class DemoRecipe(Recipe):
    """The demo: `setup()` sets torch's thread count (`demo.threads`), makes the data set and the stages' settings;
    `run()` precomputes, trains, measures and exports; `cleanup()` restores the thread count.

    Args:
        checked: the demo's checked config (`DemoRoot`): the stages' settings are made of its groups.
    """

    def __init__(self, checked: Checked, run_dir: Path) -> None:
        self.checked, self.run_dir = checked, run_dir
        groups = checked.groups
        self.d, self.model, self.predict = groups.demo, groups.model, groups.predict
        self.threads: int | None = None

    def setup(self) -> None:
        d, run_dir = self.d, self.run_dir
        self.threads = torch.get_num_threads()
        if int(d.threads) > 0:
            torch.set_num_threads(int(d.threads))
        self.spec = prepare_model(self.model)
        kind = data_kind(self.spec)  # an image and its layers; else edits, or shapes from their descriptions
        self.output = OUTPUTS[kind]
        self.data_root = make_dataset(
            run_dir / "data",
            train=d.train_samples,
            heldout=d.heldout_samples,
            size=d.image_size,
            seed=d.seed,
            controls=kind == "edit",
            layered=kind == "layered",
        )
        cache = self.checked.replaced("cache", dir=str(run_dir / "cache"), mode="cached")
        self.train = cache.replaced("data", path=str(self.data_root / "train"))
        self.heldout = self.train.replaced("data", path=str(self.data_root / "heldout"))

    def run(self) -> dict:
        run_dir = self.run_dir
        for split, name in ((self.train, "train"), (self.heldout, "heldout")):
            # precompute's own settings at their defaults, as `python -m qie.precompute` has them
            groups = replace(split.groups, precompute=PrecomputeConfig())
            precompute.start(replace(split, groups=groups), run_dir / f"precompute_{name}")
        result = train.start(self.train, run_dir / "train")
        report = self._measure(result)
        # the Hub-ready folder beside the run: run_dir/export
        export_demo(run_dir, self.train.values, report)
        return report

    def cleanup(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)

    def _measure(self, result: dict) -> dict:
        """Measure the base model and the LoRA on the held-out samples; write the picture (logged where
        `logging.report_to` says) and the report."""
        spec, d, run_dir = self.spec, self.d, self.run_dir
        edge = Edge.of(self.heldout.groups, spec)
        source = edge.source(edge.source_settings(mode="cached"))
        predictor = infer.build_predictor(self.model, replace(self.predict, lora=None), spec)
        pixels = int(edge.data.target_pixels)
        samples = scan_dataset(self.data_root / "heldout").samples
        heldout = Heldout(
            samples=samples,
            source=source,
            predictor=predictor,
            options=sampling_options(self.predict),
            seed=int(d.seed),
            image_size=int(d.image_size),
            # Each sample's frames as the model sees them: the target (a layered sample's composite), its layers.
            frames=[[_target(path, pixels, spec) for path in (sample.target, *sample.layers)] for sample in samples],
            # The frames' normalised latents (C, frames, h, w) as training sees them: the held-out cache's entries.
            encoded=[embeddings.pixel_latent for embeddings in source.get(samples)],
        )
        psnr = vae_psnr(predictor.parts.vae, heldout.frames, heldout.encoded, spec)
        base = _evaluate(heldout, self.output, run_dir / "predictions" / "base")
        predictor.load_lora(result["lora"])
        lora = _evaluate(heldout, self.output, run_dir / "predictions" / "lora")
        compared = self.output.compare(heldout, base, lora)
        report_to, step = str(self.checked.groups.logging.report_to), int(result["step"])
        picture = _picture(report_to, run_dir, compared.rows, compared.captions, compared.titles, step)
        report = _report(base.loss, lora.loss, psnr=psnr, c=compared, result=result, picture=picture, run_dir=run_dir)
        (run_dir / "demo_report.json").write_text(json.dumps(report, indent=2))
        print(format_report(report, run_dir) + f"\n  page:        {write_demo_page(run_dir, report)}")
        return report


@dataclass(frozen=True, kw_only=True)
class Heldout:
    """The held-out samples and what measuring a model on them takes.

    Args:
        frames: each sample's frames (H, W, C) in [0, 1] as the model sees them: the target (a layered sample's
            composite), then its layers.
        encoded: each sample's normalised latents (C, frames, h, w): the held-out cache's entries.
    """

    samples: list[Sample]
    source: Any
    predictor: infer.Predictor
    options: SamplingOptions
    seed: int
    image_size: int
    frames: list[list[np.ndarray]]
    encoded: list[torch.Tensor]

    @property
    def spec(self) -> ModelSpec:
        return self.predictor.spec


@dataclass(frozen=True)
class Predictions:
    """One model's held-out loss, each sample's output images and (layered) the latent error of each layer."""

    loss: float
    images: list[list[Image.Image]]
    latent_errors: list[list[float]]


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """The base model's and the LoRA's outputs measured against the targets, and the picture's rows."""

    error_before: float
    error_after: float
    unedited: float  # the error of the input itself as the output
    extra: dict
    rows: list[list[Image.Image]]
    captions: list[str]
    titles: tuple[str, ...]


@dataclass(frozen=True)
class Output:
    """How the demo predicts and measures one kind of output: one image per sample, or an image's layers.

    Args:
        predict: (held-out set, sample index, folder) -> the sample's output images, written into the folder, and
            the latent error of each (empty where not measured).
        compare: (held-out set, base model's predictions, the LoRA's) -> `Comparison`.
    """

    predict: Callable[[Heldout, int, Path], tuple[list[Image.Image], list[float]]]
    compare: Callable[[Heldout, Predictions, Predictions], Comparison]


def _evaluate(heldout: Heldout, output: Output, out_dir: Path) -> Predictions:
    """The held-out loss of the predictor's transformer and its outputs, written into `out_dir`."""
    predictor = heldout.predictor
    loss = heldout_loss(
        predictor.parts.transformer, heldout.source, heldout.samples, heldout.spec.family.loss, seed=heldout.seed
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    images, latent_errors = [], []
    for i in range(len(heldout.samples)):
        sample_images, sample_errors = output.predict(heldout, i, out_dir)
        images.append(sample_images)
        latent_errors.append(sample_errors)
    return Predictions(loss, images, latent_errors)


def _predict_image(heldout: Heldout, i: int, out_dir: Path) -> tuple[list[Image.Image], list[float]]:
    """The edit (or the image) of sample `i`: out_dir/<id>.png."""
    sample = heldout.samples[i]
    images = heldout.predictor.predict(list(sample.controls), sample.prompt, heldout.options, seed=i)[:1]
    images[0].save(out_dir / f"{sample.id}.png")
    return images, []


def _predict_layers(heldout: Heldout, i: int, out_dir: Path) -> tuple[list[Image.Image], list[float]]:
    """Sample `i`'s image split into as many layers as the sample has: out_dir/<id>/layer_N.png."""
    sample, predictor = heldout.samples[i], heldout.predictor
    latents = predictor.predict(
        list(sample.controls), sample.prompt, heldout.options, seed=i, output_type="latent", layers=len(sample.layers)
    )
    images = heldout.spec.family.decode(predictor.parts.vae, latents, output_type="pil")
    (out_dir / sample.id).mkdir(exist_ok=True)
    for n, image in enumerate(images):
        image.save(out_dir / sample.id / f"layer_{n}.png")
    return images, frame_errors(latents[0], heldout.encoded[i])[1:]  # the composite frame is not output


def _compare_images(heldout: Heldout, base: Predictions, lora: Predictions) -> Comparison:
    """Pixel error of each output image against its target; rows of control, target, base model, LoRA."""
    blank = Image.new("RGB", (heldout.image_size,) * 2, "white")  # a text-to-image sample has no control image
    controls = [open_image(sample.controls[0]) if sample.controls else blank for sample in heldout.samples]
    targets = [f[0] for f in heldout.frames]
    base_images, lora_images = [o[0] for o in base.images], [o[0] for o in lora.images]
    rows = [[c, _to_pil(t), b, lo] for c, t, b, lo in zip(controls, targets, base_images, lora_images)]
    return Comparison(
        error_before=pixel_error(base_images, targets),
        error_after=pixel_error(lora_images, targets),
        unedited=pixel_error(controls, targets),
        extra={},
        rows=rows,
        captions=[sample.prompt for sample in heldout.samples],
        titles=COLUMNS,
    )


def _compare_layers(heldout: Heldout, base: Predictions, lora: Predictions) -> Comparison:
    """Each layer's pixel and latent error, per layer position and over all; three rows per sample."""
    expected = [f[1:] for f in heldout.frames]  # what the model outputs: the layers
    alpha = heldout.spec.family.alpha
    inputs = [[open_image(sample.target, alpha)] * len(sample.layers) for sample in heldout.samples]

    def errors(outputs: list[list[Image.Image]]) -> list[list[float]]:
        return [[layer_error(i, t) for i, t in zip(o, e, strict=True)] for o, e in zip(outputs, expected)]

    base_errors, lora_errors = errors(base.images), errors(lora.images)
    latent_before, latent_after = mean_of_all(base.latent_errors), mean_of_all(lora.latent_errors)
    extra = {
        "layer_pixel_error_base": by_position(base_errors),
        "layer_pixel_error_lora": by_position(lora_errors),
        "latent_error_base": latent_before,
        "latent_error_lora": latent_after,
        "latent_error_drop": (latent_before - latent_after) / latent_before,
        "layer_latent_error_base": by_position(base.latent_errors),
        "layer_latent_error_lora": by_position(lora.latent_errors),
    }
    rows, captions = _layer_rows(heldout.samples, expected, base.images, lora.images)
    titles = LAYERED_COLUMNS + tuple(f"layer {n}" for n in range(len(rows[0]) - 1))
    # The image itself as every layer.
    unedited = mean_of_all([[layer_error(i, t) for i, t in zip(o, e)] for o, e in zip(inputs, expected)])
    return Comparison(
        error_before=mean_of_all(base_errors),
        error_after=mean_of_all(lora_errors),
        unedited=unedited,
        extra=extra,
        rows=rows,
        captions=captions,
        titles=titles,
    )


# What the model outputs, by the kind of data it trains on.
IMAGES = Output(_predict_image, _compare_images)
OUTPUTS = {"edit": IMAGES, "t2i": IMAGES, "layered": Output(_predict_layers, _compare_layers)}


def _report(
    loss_before: float, loss_after: float, psnr: float, c: Comparison, result: dict, picture: Path, run_dir: Path
) -> dict:
    """The demo's report: the losses and errors before and after, the verdict, and where its outputs are."""
    loss_drop = (loss_before - loss_after) / loss_before
    pixel_drop = (c.error_before - c.error_after) / c.error_before
    report = {
        "heldout_loss_before": loss_before,
        "heldout_loss_after": loss_after,
        "heldout_loss_drop": loss_drop,
        "vae_psnr_db": psnr,
        "pixel_error_base": c.error_before,
        "pixel_error_lora": c.error_after,
        "pixel_error_drop": pixel_drop,
        "pixel_error_unedited": c.unedited,
        # A layered model is judged by its layers' latents: its decoded layers are only as good as its VAE.
        "learned": loss_drop >= REQUIRED_LOSS_DROP
        and c.extra.get("latent_error_drop", pixel_drop) >= REQUIRED_PIXEL_DROP,
        "train_steps": result["step"],
        "demo_image": str(picture),
        "lora": result["lora"],
        "metrics": str(run_dir / "train" / "metrics.jsonl"),
        "tensorboard": str(run_dir / "train" / "tensorboard"),
        "predictions": str(run_dir / "predictions"),
    }
    return {**report, **c.extra}


def _layer_rows(
    heldout: list[Sample], expected: list, base: list, lora: list
) -> tuple[list[list[Image.Image]], list[str]]:
    """Three rows per sample (its image and layers; the base model's; the LoRA's), each the composite of its
    layers then the layers, padded with white to the samples' most layers; and their captions."""
    width = 1 + max(len(layers) for layers in expected)
    rows, captions = [], []
    for sample, layers, b, lo in zip(heldout, expected, base, lora):
        for images, caption in (([_to_pil(x) for x in layers], sample.prompt), (b, "base model"), (lo, "LoRA")):
            row = [composite(images), *images]
            rows.append(row + [Image.new("RGB", row[0].size, "white")] * (width - len(row)))
            captions.append(caption)
    return rows, captions


def _picture(report_to: str, run_dir: Path, rows: list, captions: list[str], titles: tuple, step: int) -> Path:
    """Write demo.png and log the same grid to the tracker (TensorBoard by default) of the training run."""
    grid = captioned_grid(rows, captions, titles, TILE)
    path = run_dir / "demo.png"
    grid.save(path)
    logger = MetricsLogger(run_dir / "train", report_to)
    logger.log_image(GRID_TAG, grid, step)
    logger.close()
    return path


def _target(path: Path, pixels: int, spec: ModelSpec) -> np.ndarray:
    """A target frame as the model sees it: resized to `pixels`, (H, W, 3 or 4 with alpha) in [0, 1]."""
    return (prepare_target(open_image(path, spec.family.alpha), pixels).permute(1, 2, 0).numpy() + 1) / 2


def _to_pil(array: np.ndarray) -> Image.Image:
    return Image.fromarray((array * 255).round().clip(0, 255).astype(np.uint8))
