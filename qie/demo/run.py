"""The demo: generate a synthetic edit data set, precompute, train a LoRA from the cache, edit the held-out
images with the base model and with the LoRA, and show and measure the difference.

It writes `demo.png` (one row per held-out sample: control, target, base output, LoRA output, the prompt
under it), logs the same picture to TensorBoard, and writes `demo_report.json`: held-out loss before and
after, the VAE's reconstruction PSNR on the held-out targets, and the pixel error of the base and LoRA
outputs against the targets. It says the LoRA learned only when the held-out loss fell by
REQUIRED_LOSS_DROP and the pixel error by REQUIRED_PIXEL_DROP.
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
from qie.data.samples import Sample, scan_dataset
from qie.demo.grid import captioned_grid
from qie.demo.synthetic import make_dataset
from qie.models import ModelSpec
from qie.stages import infer, precompute, train
from qie.stages.common import build_source, sampling_options, value
from qie.training.evaluate import heldout_loss
from qie.training.logging import MetricsLogger

REQUIRED_LOSS_DROP = 0.2
REQUIRED_PIXEL_DROP = 0.3
COLUMNS = ("control", "target", "base model", "LoRA")
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
    edits = spec.max_control_images > 0  # else a text-to-image model: shapes from their descriptions
    data_root = make_dataset(run_dir / "data", d.train_samples, d.heldout_samples, d.image_size, d.seed, edits)
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
    targets = [_target(sample, int(cfg.model.vae_image_pixels), spec) for sample in heldout]

    def evaluate(tag: str) -> tuple[float, list[Image.Image], float]:
        loss = heldout_loss(predictor.parts.transformer, source, heldout, spec.loss, seed=int(d.seed))
        images = []
        out_dir = run_dir / "predictions" / tag
        out_dir.mkdir(parents=True, exist_ok=True)
        for i, sample in enumerate(heldout):
            image = predictor.predict(list(sample.controls), sample.prompt, options, seed=i)[0]
            image.save(out_dir / f"{sample.id}.png")
            images.append(image)
        return loss, images, pixel_error(images, targets)

    psnr = vae_psnr(predictor, targets, spec)
    loss_before, base_images, error_before = evaluate("base")
    predictor.load_lora(result["lora"])
    loss_after, lora_images, error_after = evaluate("lora")

    blank = Image.new("RGB", (int(d.image_size),) * 2, "white")  # a text-to-image sample has no control image
    controls = [open_image(sample.controls[0]) if sample.controls else blank for sample in heldout]
    rows = [[c, _to_pil(t), b, lo] for c, t, b, lo in zip(controls, targets, base_images, lora_images)]
    picture = _picture(cfg, run_dir, rows, [sample.prompt for sample in heldout], int(result["step"]))

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
        "pixel_error_unedited": pixel_error(controls, targets),
        "learned": loss_drop >= REQUIRED_LOSS_DROP and pixel_drop >= REQUIRED_PIXEL_DROP,
        "train_steps": result["step"],
        "demo_image": str(picture),
        "lora": result["lora"],
        "metrics": str(run_dir / "train" / "metrics.jsonl"),
        "tensorboard": str(run_dir / "train" / "tensorboard"),
        "predictions": str(run_dir / "predictions"),
    }
    (run_dir / "demo_report.json").write_text(json.dumps(report, indent=2))
    print(format_report(report, run_dir))
    return report


def _picture(cfg: DictConfig, run_dir: Path, rows: list, prompts: list[str], step: int) -> Path:
    """Write demo.png and log the same grid to the tracker (TensorBoard by default) of the training run."""
    grid = captioned_grid(rows, prompts, COLUMNS, TILE)
    path = run_dir / "demo.png"
    grid.save(path)
    logger = MetricsLogger(run_dir / "train", str(value(cfg.logging.report_to)))
    logger.log_image(GRID_TAG, grid, step)
    logger.close()
    return path


def _target(sample: Sample, pixels: int, spec: ModelSpec) -> np.ndarray:
    """The sample's target as the model sees it: resized to `pixels`, (H, W, 3 or 4 with alpha) in [0, 1]."""
    return (prepare_target(open_image(sample.target, spec.alpha), pixels).permute(1, 2, 0).numpy() + 1) / 2


def _to_pil(array: np.ndarray) -> Image.Image:
    return Image.fromarray((array * 255).round().clip(0, 255).astype(np.uint8))


def pixel_error(images: list[Image.Image], targets: list[np.ndarray]) -> float:
    """Mean absolute difference of the images from their targets, pixels in [0, 1]."""
    errors = []
    for image, target in zip(images, targets):
        pred = np.asarray(image.convert("RGB").resize(target.shape[1::-1]), dtype=np.float32) / 255.0
        errors.append(float(np.abs(pred - target[..., :3]).mean()))
    return float(np.mean(errors))


def vae_psnr(predictor: infer.Predictor, targets: list[np.ndarray], spec: ModelSpec) -> float:
    """PSNR (dB) of the targets encoded and decoded by the model's VAE, as the pipelines encode and decode."""
    squared = []
    for target in targets:
        pixels = torch.from_numpy(target * 2 - 1).permute(2, 0, 1).float()
        latent = predictor.encoder.encode_latents([pixels])[0].unsqueeze(0)
        decoded = spec.decoder(predictor.parts.vae, latent, output_type="np")[0]
        squared.append(float(((decoded - target) ** 2).mean()))
    return 10 * math.log10(1.0 / max(float(np.mean(squared)), 1e-12))


def format_report(r: dict, run_dir: Path) -> str:
    if r["learned"]:
        verdict = "the LoRA learned the edit"
    else:
        verdict = (
            f"did NOT learn the edit (needs {REQUIRED_LOSS_DROP:.0%} lower loss and {REQUIRED_PIXEL_DROP:.0%} "
            "lower pixel error)"
        )
    return "\n".join(
        [
            "",
            f"qie demo: {r['train_steps']} training steps from the cache; {verdict}",
            f"  held-out loss (fixed noise)  before {r['heldout_loss_before']:.4f}  after {r['heldout_loss_after']:.4f}"
            f"  ({r['heldout_loss_drop']:.0%} lower)",
            f"  held-out pixel error         base   {r['pixel_error_base']:.4f}  LoRA  {r['pixel_error_lora']:.4f}"
            f"  ({r['pixel_error_drop']:.0%} lower; the unedited control: {r['pixel_error_unedited']:.4f})",
            f"  VAE reconstruction PSNR      {r['vae_psnr_db']:.1f} dB (held-out targets)",
            f"  picture:     {r['demo_image']}  (rows: control, target, base model, LoRA; the prompt under each)",
            f"  images:      {r['predictions']}/{{base,lora}}",
            f"  metrics:     {r['metrics']}",
            f"  TensorBoard: tensorboard --logdir {r['tensorboard']}",
            f"  report:      {run_dir / 'demo_report.json'}",
        ]
    )
