"""The infer stage: edit one image (or each row of a data set) with the base model, optionally a LoRA.

`Predictor` holds the built parts and is what a notebook keeps: build once, call `predict` many times.
`run(cfg, run_dir)` is what `python -m qie.infer` calls; `predict.merge_to` instead fuses the LoRA into
the transformer and saves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from omegaconf import DictConfig
from PIL import Image

from qie.components import Parts, load_parts
from qie.data.images import condition_images, open_image
from qie.data.samples import scan_dataset
from qie.encode import Encoder
from qie.errors import ConfigError, QieError
from qie.sampling import SamplingOptions, decode_latents, sample_edit, vae_scale_factor
from qie.stages.common import sampling_options, value
from qie.training.lora import load_lora, merge_lora, save_transformer

INFER_PARTS = ("vae", "text_encoder", "tokenizer", "processor", "transformer", "scheduler")


class Predictor:
    """Edits images with built parts, exactly as the diffusers Edit / Edit-Plus pipelines would.

    Args:
        parts: all of INFER_PARTS, each already on its device.
        variant: "edit" or "edit_plus".
        vae_image_pixels: area the control images are resized to for the VAE (and the output size).
        vl_image_pixels: area the control images are resized to for Qwen2.5-VL.
        max_control_images: how many images one edit may take.
    """

    def __init__(
        self,
        parts: Parts,
        variant: str,
        vae_image_pixels: int,
        vl_image_pixels: int,
        max_control_images: int = 1,
    ) -> None:
        self.parts = parts
        self.variant = variant
        self.vae_image_pixels = vae_image_pixels
        self.vl_image_pixels = vl_image_pixels
        self.max_control_images = max_control_images
        self.encoder = Encoder(parts, variant)
        self.vae_scale_factor = vae_scale_factor(parts.vae)

    def load_lora(self, path: str | Path, scale: float = 1.0) -> Path:
        """Load (or replace) the LoRA on the transformer. Raises ModelLoadError when it does not fit."""
        return load_lora(self.parts.transformer, path, scale)

    @torch.no_grad()
    def predict(
        self,
        images: Sequence[Image.Image | str | Path] | Image.Image | str | Path,
        prompt: str,
        options: SamplingOptions | None = None,
        output_type: str = "pil",
        progress: bool = False,
        **overrides: Any,
    ) -> Any:
        """Edit `images` (one for Edit; one or more for Edit-Plus) following `prompt`.

        Args:
            images: control images (PIL or paths), in the order the prompt refers to them.
            prompt: the edit instruction.
            options: sampling options (default: `SamplingOptions()`); `overrides` replace single fields
                (e.g. `num_inference_steps=20, seed=3`).
            output_type: "pil" (list of images) or "np" (float array (N, H, W, 3) in [0, 1]).

        Raises:
            ConfigError: no prompt or image, or more images than the model takes.
            DataError: an image that is missing or unreadable.
        """
        options = replace(options or SamplingOptions(), **overrides)
        pil = _open_all(images)
        if prompt is None:
            raise ConfigError("no prompt given: set predict.prompt to the edit instruction")
        if not pil:
            raise ConfigError("no input image given: set predict.image (or predict.images for Edit-Plus)")
        if len(pil) > self.max_control_images:
            raise ConfigError(
                f"{len(pil)} input images given, but this model ({self.variant}) takes at most "
                f"{self.max_control_images}: use an Edit-Plus model for several images"
            )
        pixels, vl_images = zip(*(condition_images(im, self.vae_image_pixels, self.vl_image_pixels) for im in pil))
        (embed,) = self.encoder.encode_prompts([prompt], [list(vl_images)])
        negative = None
        if options.negative_prompt is not None and options.true_cfg_scale > 1:
            (negative,) = self.encoder.encode_prompts([options.negative_prompt], [list(vl_images)])
        controls = [self.encoder.encode_latents([p])[0] for p in pixels]
        latents = sample_edit(
            self.parts.transformer, self.parts.scheduler, self.vae_scale_factor, embed, negative, controls,
            self.encoder.spec.output_image, options, progress=progress,
        )  # fmt: skip
        return decode_latents(self.parts.vae, latents, output_type=output_type)


def _open_all(images: Any) -> list[Image.Image]:
    if images is None:
        return []
    if isinstance(images, (str, Path, Image.Image)):
        images = [images]
    return [im.convert("RGB") if isinstance(im, Image.Image) else open_image(im) for im in images]


def build_predictor(cfg: DictConfig) -> Predictor:
    """Build the parts on `predict.devices` and the Predictor; loads `predict.lora` when set.

    Raises:
        ConfigError: a device that does not exist; ModelLoadError: a part or LoRA that cannot be loaded.
    """
    parts = load_parts(cfg.model, INFER_PARTS, devices=dict(cfg.predict.devices))
    predictor = Predictor(
        parts,
        str(value(cfg.model.variant)),
        int(cfg.model.vae_image_pixels),
        int(cfg.model.vl_image_pixels),
        int(cfg.model.max_control_images),
    )
    if cfg.predict.lora:
        predictor.load_lora(cfg.predict.lora, float(cfg.predict.lora_scale))
    return predictor


def resolve_output(path: str, run_dir: Path) -> Path:
    """An output path: relative paths go inside the run directory, absolute ones stay."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else run_dir / p


def numbered(path: Path, count: int) -> list[Path]:
    """`out.png` for one image, `out_0.png, out_1.png, ...` for several."""
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}_{i}{path.suffix or '.png'}") for i in range(count)]


def _save(images: list[Image.Image], path: Path) -> list[Path]:
    paths = numbered(path, len(images))
    for image, p in zip(images, paths):
        p.parent.mkdir(parents=True, exist_ok=True)
        image.save(p)
    return paths


def run(cfg: DictConfig, run_dir: Path) -> list[Path]:
    """Run inference (single image, or batch with `predict.input`) or the LoRA merge (`predict.merge_to`).

    Returns:
        The files written (images, or the merged transformer folder).

    Raises:
        QieError subclasses naming the key, file or device at fault.
    """
    p = cfg.predict
    if p.merge_to:
        return [merge(cfg, run_dir)]
    if p.input:
        return run_batch(cfg, run_dir)
    sources = list(p.images) if p.images else ([p.image] if p.image else [])
    if not sources:
        raise ConfigError(
            "no input image: set predict.image=FILE (predict.images=[A,B] for Edit-Plus, or predict.input=DATASET)"
        )
    if p.prompt is None:
        raise ConfigError('no prompt: set predict.prompt="the edit instruction"')
    images = _open_all(sources)  # fail on a bad image before spending time on building the model
    predictor = build_predictor(cfg)
    written = _save(
        predictor.predict(images, p.prompt, sampling_options(p), progress=True), resolve_output(p.output, run_dir)
    )
    for path in written:
        print(f"infer: wrote {path}")
    return written


def run_batch(cfg: DictConfig, run_dir: Path) -> list[Path]:
    """One output per row of the data set `predict.input`, at `<output_dir>/<id>.png`; bad rows are reported."""
    data = scan_dataset(cfg.predict.input, "auto", require_target=False)
    out_dir = resolve_output(cfg.predict.output_dir, run_dir)
    predictor = build_predictor(cfg)
    written: list[Path] = []
    failures = [f"{d.id}: {d.path}: {d.reason}" for d in data.problems]
    for sample in data.samples:
        try:
            images = predictor.predict(
                list(sample.controls), sample.prompt, sampling_options(cfg.predict), progress=True
            )
        except QieError as e:  # one bad row must not stop the others
            failures.append(f"{sample.id}: {e}")
            continue
        written += _save(images, out_dir / _safe_relative(sample.id).with_suffix(".png"))
    print(f"infer: wrote {len(written)} image(s) for {len(data.samples)} row(s) to {out_dir}")
    for failure in failures:
        print(f"infer: skipped {failure}")
    return written


def _safe_relative(sample_id: str) -> Path:
    # Manifest ids may be paths; keep their folders but never let one climb out of output_dir.
    parts = [part for part in PurePosixPath(sample_id).parts if part not in ("", ".", "..", "/")]
    return Path(*parts) if parts else Path("sample")


def merge(cfg: DictConfig, run_dir: Path) -> Path:
    """Fuse `predict.lora` into the transformer and save it to `<merge_to>/transformer`."""
    p = cfg.predict
    if not p.lora:
        raise ConfigError("predict.merge_to needs predict.lora: the LoRA to merge")
    if str(value(cfg.model.quantize)) != "none":
        raise ConfigError("predict.merge_to needs the full-precision transformer: set model.quantize=none")
    parts = load_parts(cfg.model, ["transformer"], devices={"transformer": p.devices.transformer})
    load_lora(parts.transformer, p.lora, float(p.lora_scale))
    out = save_transformer(merge_lora(parts.transformer), resolve_output(p.merge_to, run_dir))
    print(f"infer: merged {p.lora} (scale {p.lora_scale}) into the transformer, saved to {out}")
    return out
