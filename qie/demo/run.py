"""The demo: generate a synthetic edit data set, precompute, train a LoRA from the cache, edit the held-out
images with the base model and with the LoRA, and show and measure the difference.

It writes `demo.png` (one row per held-out sample: control, target, base output, LoRA output, the prompt
under it), logs the same picture to TensorBoard, and writes `demo_report.json`: held-out loss before and
after, the VAE's reconstruction PSNR on the held-out targets, and the pixel error of the base and LoRA
outputs against the targets. It says the LoRA learned only when the held-out loss fell by
REQUIRED_LOSS_DROP and the pixel error by REQUIRED_PIXEL_DROP.

For a model that splits an image into layers (`ModelFamily.layered`) the data set is the layered one (an
image of shapes and its layers, `qie.demo.synthetic`), and each held-out image is split into as many layers as
its sample has (`predict.layers`). Each layer is measured twice, per layer and over all of them: the latent
error (the sampled layer's normalised latent against the encoded target layer) and the pixel error (premultiplied
RGBA: a transparent pixel's colour does not count). The verdict takes the latent error in place of the pixel
error: decoded layers are only as good as the VAE, and the tiny layered model's is untrained. Its picture has
three rows per sample (the image and its layers, the base model's, the LoRA's), each starting with the composite
of its layers, layers on a checkerboard where they are transparent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from qie.components import prepare_model
from qie.config import for_stage
from qie.data.images import open_image, prepare_target
from qie.data.samples import Sample
from qie.data.scan import scan_dataset
from qie.demo.grid import captioned_grid
from qie.demo.synthetic import composite, make_dataset
from qie.models import ModelSpec
from qie.stages import infer, precompute, train
from qie.stages.common import build_source, sampling_options, value
from qie.training.evaluate import heldout_loss
from qie.training.logging import MetricsLogger

REQUIRED_LOSS_DROP = 0.2
REQUIRED_PIXEL_DROP = 0.3
COLUMNS = ("control", "target", "base model", "LoRA")
# A layered model's picture: the composite, then one column per layer (as many as the samples' most).
LAYERED_COLUMNS = ("image",)
TILE = 128
GRID_TAG = "demo/heldout"


def _with(cfg: DictConfig, **updates) -> DictConfig:
    out = cfg.copy()
    for key, val in updates.items():
        OmegaConf.update(out, key, val, merge=False)
    return out


@contextmanager
def _threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to `count` (0: left as it is), restored afterwards."""
    before = torch.get_num_threads()
    if count > 0:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Run the demo in `run_dir`; returns the report also written to `run_dir/demo_report.json`."""
    with _threads(int(cfg.demo.threads)):
        return _run(cfg, Path(run_dir))


def _run(cfg: DictConfig, run_dir: Path) -> dict:
    d = cfg.demo
    spec = prepare_model(cfg.model)
    layered = spec.family.layered  # an image and its layers; else edits, or shapes from their descriptions
    edits = spec.max_control_images > 0
    data_root = make_dataset(run_dir / "data", d.train_samples, d.heldout_samples, d.image_size, d.seed, edits, layered)
    cache_dir = str(run_dir / "cache")
    train_cfg = _with(cfg, **{"data.path": str(data_root / "train"), "cache.dir": cache_dir, "cache.mode": "cached"})
    heldout_cfg = _with(train_cfg, **{"data.path": str(data_root / "heldout")})

    for split_cfg, name in ((train_cfg, "train"), (heldout_cfg, "heldout")):
        precompute.run(for_stage(split_cfg, "precompute"), run_dir / f"precompute_{name}")

    result = train.run(train_cfg, run_dir / "train")

    heldout = scan_dataset(data_root / "heldout").samples
    source = build_source(heldout_cfg, mode="cached", spec=spec)
    predictor = infer.build_predictor(_with(heldout_cfg, **{"predict.lora": None}), spec)
    options = sampling_options(cfg.predict)
    pixels = int(cfg.data.target_pixels)
    # Each sample's frames as the model sees them: the target (a layered sample's composite), then its layers.
    frames = [[_target(path, pixels, spec) for path in (sample.target, *sample.layers)] for sample in heldout]
    expected = [f[1:] if layered else f for f in frames]  # what the model outputs: the layers, or the target

    # The frames' normalised latents (C, frames, h, w) as training sees them: the held-out cache's entries.
    encoded = [embeddings.pixel_latent for embeddings in source.get(heldout)]

    def evaluate(tag: str) -> tuple[float, list[list[Image.Image]], list[list[float]]]:
        """Held-out loss, each sample's output images and (layered) the latent error of each of its layers."""
        loss = heldout_loss(predictor.parts.transformer, source, heldout, spec.loss, seed=int(d.seed))
        outputs, latent_errors = [], []
        out_dir = run_dir / "predictions" / tag
        out_dir.mkdir(parents=True, exist_ok=True)
        for i, sample in enumerate(heldout):
            if layered:  # as many layers as the sample has: out_dir/<id>/layer_N.png
                latents = predictor.predict(list(sample.controls), sample.prompt, options, seed=i,
                                            output_type="latent", layers=len(sample.layers))  # fmt: skip
                images = spec.decoder(predictor.parts.vae, latents, output_type="pil")
                latent_errors.append(frame_errors(latents[0], encoded[i])[1:])  # the composite frame is not output
                (out_dir / sample.id).mkdir(exist_ok=True)
                for n, image in enumerate(images):
                    image.save(out_dir / sample.id / f"layer_{n}.png")
            else:
                images = predictor.predict(list(sample.controls), sample.prompt, options, seed=i)[:1]
                images[0].save(out_dir / f"{sample.id}.png")
            outputs.append(images)
        return loss, outputs, latent_errors

    psnr = vae_psnr(predictor, frames, encoded, spec)
    loss_before, base_outputs, base_latent = evaluate("base")
    predictor.load_lora(result["lora"])
    loss_after, lora_outputs, lora_latent = evaluate("lora")

    prompts = [sample.prompt for sample in heldout]
    extra: dict = {}
    if layered:
        inputs = [[open_image(sample.target, spec.alpha)] * len(sample.layers) for sample in heldout]
        base_errors = [[layer_error(i, t) for i, t in zip(o, e, strict=True)] for o, e in zip(base_outputs, expected)]
        lora_errors = [[layer_error(i, t) for i, t in zip(o, e, strict=True)] for o, e in zip(lora_outputs, expected)]
        error_before, error_after = _mean_of_all(base_errors), _mean_of_all(lora_errors)
        # The image itself as every layer.
        unedited = _mean_of_all([[layer_error(i, t) for i, t in zip(o, e)] for o, e in zip(inputs, expected)])
        latent_before, latent_after = _mean_of_all(base_latent), _mean_of_all(lora_latent)
        extra = {
            "layer_pixel_error_base": by_position(base_errors),
            "layer_pixel_error_lora": by_position(lora_errors),
            "latent_error_base": latent_before,
            "latent_error_lora": latent_after,
            "latent_error_drop": (latent_before - latent_after) / latent_before,
            "layer_latent_error_base": by_position(base_latent),
            "layer_latent_error_lora": by_position(lora_latent),
        }
        rows, captions = _layer_rows(heldout, expected, base_outputs, lora_outputs)
        titles = LAYERED_COLUMNS + tuple(f"layer {n}" for n in range(len(rows[0]) - 1))
    else:
        blank = Image.new("RGB", (int(d.image_size),) * 2, "white")  # a text-to-image sample has no control image
        controls = [open_image(sample.controls[0]) if sample.controls else blank for sample in heldout]
        targets = [f[0] for f in frames]
        base_images, lora_images = [o[0] for o in base_outputs], [o[0] for o in lora_outputs]
        error_before, error_after = pixel_error(base_images, targets), pixel_error(lora_images, targets)
        unedited = pixel_error(controls, targets)
        rows = [[c, _to_pil(t), b, lo] for c, t, b, lo in zip(controls, targets, base_images, lora_images)]
        captions, titles = prompts, COLUMNS
    picture = _picture(cfg, run_dir, rows, captions, titles, int(result["step"]))

    loss_drop = (loss_before - loss_after) / loss_before
    pixel_drop = (error_before - error_after) / error_before
    report = {
        "heldout_loss_before": loss_before,
        "heldout_loss_after": loss_after,
        "heldout_loss_drop": loss_drop,
        "vae_psnr_db": psnr,
        "pixel_error_base": error_before,
        "pixel_error_lora": error_after,
        "pixel_error_drop": pixel_drop,
        "pixel_error_unedited": unedited,
        # A layered model is judged by its layers' latents: its decoded layers are only as good as its VAE.
        "learned": loss_drop >= REQUIRED_LOSS_DROP
        and extra.get("latent_error_drop", pixel_drop) >= REQUIRED_PIXEL_DROP,
        "train_steps": result["step"],
        "demo_image": str(picture),
        "lora": result["lora"],
        "metrics": str(run_dir / "train" / "metrics.jsonl"),
        "tensorboard": str(run_dir / "train" / "tensorboard"),
        "predictions": str(run_dir / "predictions"),
    }
    report.update(extra)
    (run_dir / "demo_report.json").write_text(json.dumps(report, indent=2))
    print(format_report(report, run_dir))
    return report


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


def _picture(cfg: DictConfig, run_dir: Path, rows: list, captions: list[str], titles: tuple, step: int) -> Path:
    """Write demo.png and log the same grid to the tracker (TensorBoard by default) of the training run."""
    grid = captioned_grid(rows, captions, titles, TILE)
    path = run_dir / "demo.png"
    grid.save(path)
    logger = MetricsLogger(run_dir / "train", str(value(cfg.logging.report_to)))
    logger.log_image(GRID_TAG, grid, step)
    logger.close()
    return path


def _target(path: Path, pixels: int, spec: ModelSpec) -> np.ndarray:
    """A target frame as the model sees it: resized to `pixels`, (H, W, 3 or 4 with alpha) in [0, 1]."""
    return (prepare_target(open_image(path, spec.alpha), pixels).permute(1, 2, 0).numpy() + 1) / 2


def _to_pil(array: np.ndarray) -> Image.Image:
    return Image.fromarray((array * 255).round().clip(0, 255).astype(np.uint8))


def pixel_error(images: list[Image.Image], targets: list[np.ndarray]) -> float:
    """Mean absolute difference of the images from their targets, pixels in [0, 1]."""
    errors = []
    for image, target in zip(images, targets):
        pred = np.asarray(image.convert("RGB").resize(target.shape[1::-1]), dtype=np.float32) / 255.0
        errors.append(float(np.abs(pred - target[..., :3]).mean()))
    return float(np.mean(errors))


def layer_error(image: Image.Image, target: np.ndarray) -> float:
    """Mean absolute difference of an RGBA layer from its target (H, W, 4) in [0, 1], both premultiplied by
    their alpha: where a layer is transparent its colour does not count."""
    pred = np.asarray(image.convert("RGBA").resize(target.shape[1::-1]), dtype=np.float32) / 255.0

    def premultiplied(x: np.ndarray) -> np.ndarray:
        return np.concatenate([x[..., :3] * x[..., 3:], x[..., 3:]], axis=-1)

    return float(np.abs(premultiplied(pred) - premultiplied(target)).mean())


def by_position(errors: list[list[float]]) -> list[float]:
    """Per layer position (0: the background), the mean of the samples' errors at that position."""
    positions: dict[int, list[float]] = {}
    for sample in errors:
        for n, error in enumerate(sample):
            positions.setdefault(n, []).append(error)
    return [float(np.mean(positions[n])) for n in sorted(positions)]


def _mean_of_all(errors: list[list[float]]) -> float:
    return float(np.mean([e for sample in errors for e in sample]))


def frame_errors(latents: torch.Tensor, target: torch.Tensor) -> list[float]:
    """Mean absolute difference of each frame of normalised latents (C, frames, h, w) from the target's."""
    return [float((latents[:, n].float().cpu() - target[:, n]).abs().mean()) for n in range(target.shape[1])]


def vae_psnr(
    predictor: infer.Predictor, frames: list[list[np.ndarray]], encoded: list[torch.Tensor], spec: ModelSpec
) -> float:
    """PSNR (dB) of each sample's frames (H, W, C) in [0, 1] decoded by the model's VAE from their latents
    (`encoded`, the cached entries: encoded as the pipelines encode; a layered model's decoder drops the composite
    frame: its layers count)."""
    squared = []
    for sample_frames, latent in zip(frames, encoded):
        decoded = spec.decoder(predictor.parts.vae, latent.unsqueeze(0), output_type="np")
        expected = np.stack(sample_frames[len(sample_frames) - len(decoded) :])
        squared.append(float(((np.asarray(decoded) - expected) ** 2).mean()))
    return 10 * math.log10(1.0 / max(float(np.mean(squared)), 1e-12))


def format_report(r: dict, run_dir: Path) -> str:
    layered = "latent_error_drop" in r
    judged = "latent error" if layered else "pixel error"
    if r["learned"]:
        verdict = "the LoRA learned to split the images" if layered else "the LoRA learned the edit"
    else:
        verdict = (
            f"did NOT learn {'the split' if layered else 'the edit'} (needs {REQUIRED_LOSS_DROP:.0%} lower loss and "
            f"{REQUIRED_PIXEL_DROP:.0%} lower {judged})"
        )
    unedited = "the image itself as every layer" if layered else "the unedited control"
    lines = [
        "",
        f"qie demo: {r['train_steps']} training steps from the cache; {verdict}",
        f"  held-out loss (fixed noise)  before {r['heldout_loss_before']:.4f}  after {r['heldout_loss_after']:.4f}"
        f"  ({r['heldout_loss_drop']:.0%} lower)",
    ]
    if layered:
        lines.append(
            f"  held-out latent error        base   {r['latent_error_base']:.4f}  LoRA  {r['latent_error_lora']:.4f}"
            f"  ({r['latent_error_drop']:.0%} lower)"
        )
        lines += _per_layer(r["layer_latent_error_base"], r["layer_latent_error_lora"])
    lines.append(
        f"  held-out pixel error         base   {r['pixel_error_base']:.4f}  LoRA  {r['pixel_error_lora']:.4f}"
        f"  ({r['pixel_error_drop']:.0%} lower; {unedited}: {r['pixel_error_unedited']:.4f})"
    )
    if layered:
        lines += _per_layer(r["layer_pixel_error_base"], r["layer_pixel_error_lora"])
        picture = "rows per sample: its image and layers, the base model's, the LoRA's; layers on a checkerboard"
    else:
        picture = "columns: control, target, base model, LoRA; the prompt under each row"
    return "\n".join(
        [
            *lines,
            f"  VAE reconstruction PSNR      {r['vae_psnr_db']:.1f} dB (held-out targets)",
            f"  picture:     {r['demo_image']}  ({picture})",
            f"  images:      {r['predictions']}/{{base,lora}}",
            f"  metrics:     {r['metrics']}",
            f"  TensorBoard: tensorboard --logdir {r['tensorboard']}",
            f"  report:      {run_dir / 'demo_report.json'}",
        ]
    )


def _per_layer(base: list[float], lora: list[float]) -> list[str]:
    """One report line per layer position, aligned under the totals."""
    names = [f"    layer {n}" + (" (background)" if n == 0 else "") for n in range(len(base))]
    return [f"{name:<31}base   {b:.4f}  LoRA  {lo:.4f}" for name, b, lo in zip(names, base, lora)]
