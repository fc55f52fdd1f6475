"""The infer stage: edit one image, make one from a prompt (text to image, or an Edit-Plus model given no
image), or do so for each row of a data set, with the base model and optionally a LoRA.

`Predictor` holds the built parts and is what a notebook keeps: build once, call `predict` many times.
`run(cfg, run_dir)` is what `python -m qie.infer` calls; `predict.merge_to` instead fuses the LoRA into
the transformer and saves it. The transformer is built with `model.fuse_loras` fused into it, and a LoRA trained on
another fused base is refused (`qie.adapters.fused_base.check_lora_base`) unless `predict.allow_other_base=true`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from PIL import Image

from qie.adapters.fused_base import FusedBase, check_lora_base
from qie.adapters.lora import load_lora, merge_lora, save_transformer
from qie.checks import Checked, check
from qie.components import LoadSettings, Parts, load_parts, pipeline_config, prepare_model, resolve_device
from qie.config.data import DataConfig
from qie.config.model import ModelConfig
from qie.config.predict import PredictConfig
from qie.data.images import as_image, condition_images
from qie.data.samples import prompt_problem
from qie.embedding.encode import Encoder, text_tokens
from qie.errors import ConfigError, ModelLoadError, QieError
from qie.models import ModelSpec, text_positions
from qie.models.sampling import SamplingOptions, latent_sizes
from qie.runtime.guards import damaged_weights, nonfinite_weights
from qie.stages.datasets import read_data
from qie.stages.recipe import Recipe
from qie.stages.settings import data_source, fused_base, sampling_options


class Predictor:
    """Makes images with built parts, exactly as the model's diffusers pipeline would.

    Args:
        parts: the parts of the spec's pipeline (`spec.part_names`), each already on its device.
        spec: the model description (pipeline, condition sizes, control counts, output size rule).
        base: the LoRAs fused into `parts.transformer` (`model.fuse_loras`), which a LoRA's record must name.
    """

    def __init__(self, parts: Parts, spec: ModelSpec, base: FusedBase | None = None) -> None:
        self.parts = parts
        self.spec = spec
        self.base = base or FusedBase()
        self.encoder = Encoder(parts, spec)
        self.vae_scale_factor = spec.family.vae_scale(parts.vae)
        self.swap: tuple[int, torch.device] | None = None
        self._swapper = None

    def load_lora(self, path: str | Path, scale: float = 1.0, allow_other_base: bool = False) -> Path:
        """Load (or replace) the LoRA on the transformer.

        Raises:
            ModelLoadError: it does not fit.
            ConfigError: it was trained on another fused base than this transformer's (unless `allow_other_base`).
        """
        if warning := check_lora_base(path, self.base, allow_other_base):
            print(f"infer: warning: {warning}")
        swap = self.swap
        if swap is not None:  # the LoRA of the swapped blocks is swapped with them
            self.swap_blocks(0, swap[1])
        try:
            return load_lora(self.parts.transformer, path, scale)
        finally:
            if swap is not None:
                self.swap_blocks(*swap)

    def swap_blocks(self, count: int, device: torch.device) -> None:
        """Keep the first `count` transformer blocks in CPU memory, each copied to `device` just before it runs
        (`predict.blocks_to_swap`; 0 stops swapping and leaves those blocks in CPU memory)."""
        from qie.runtime.offload import BlockSwapper

        if self._swapper is not None:
            self._swapper.remove()
        transformer = self.parts.transformer
        blocks = getattr(transformer, self.spec.family.blocks)
        self._swapper = BlockSwapper(transformer, blocks, count, device) if count else None
        self.swap = (count, device) if count else None

    @torch.no_grad()
    def predict(
        self,
        images: Sequence[Image.Image | str | Path] | Image.Image | str | Path | None,
        prompt: str,
        options: SamplingOptions | None = None,
        output_type: str = "pil",
        progress: bool = False,
        **overrides: Any,
    ) -> Any:
        """Edit `images` (one for Edit; none to three for Edit-Plus; none for text to image) following `prompt`.

        Args:
            images: control images (PIL images, numpy arrays (H, W, 3) uint8 or float in [0, 1], or paths), in
                the order the prompt refers to them; None or [] for none.
            prompt: the instruction (the image description for text to image).
            options: sampling options (default: `SamplingOptions()`); `overrides` replace single fields
                (e.g. `num_inference_steps=20, seed=3`). Without height and width the output size follows the
                model's rule (`ModelSpec.output_size`).
            output_type: "pil" (list of images) or "np" (float array (N, H, W, C) in [0, 1]; C = 4 for an RGBA
                model such as Qwen-Image-2.1, whose outputs keep their alpha), or "latent": the normalised
                latents before decoding, (N, C, frames, h, w) (a layered model's frames: the composite, then
                the layers), which `spec.family.decode` turns into those images.

        Raises:
            ConfigError: no prompt, or a number of images the model does not take.
            DataError: an image that is missing or unreadable.
        """
        spec = self.spec
        options = replace(options or SamplingOptions(), **overrides).resolved(spec.call_defaults())
        pil = open_images(images, spec.family.alpha)
        if prompt is None:
            raise ConfigError("no prompt given: set predict.prompt to the instruction")
        if too_long := prompt_problem(prompt):
            raise ConfigError(f"predict.prompt: {too_long}")
        if not pil and self.spec.needs_controls:
            raise ConfigError("no input image given: set predict.image (or predict.images for Edit-Plus)")
        problem = self.spec.control_problem(len(pil))
        if problem:
            raise ConfigError(f"{len(pil)} input images given: {problem}")
        pixels, vl_images = [], []
        for im in pil:
            vae_in, vl_in = condition_images(im, spec.vae_image_pixels, spec.vl_image_pixels)
            pixels.append(vae_in)
            vl_images.append(vl_in)
        (entry,) = self.encoder.encode_prompt_entries([prompt], [vl_images])
        negative = None
        if options.negative_prompt is not None and options.true_cfg_scale > 1:
            (neg,) = self.encoder.encode_prompt_entries([options.negative_prompt], [vl_images])
            negative = (neg["embed"], neg.get("image_mask"))
        controls = [self.encoder.encode_latents([p])[0] for p in pixels]
        f = self.vae_scale_factor
        size = spec.output_size(options.height, options.width, latent_sizes(controls, f), None, f)
        per_token = spec.family.planner.latent_pixels
        frames = [(1, h // per_token, w // per_token) for h, w in [size, *latent_sizes(controls, f)]]
        limit = spec.family.text_positions(spec, frames)
        text_positions.check(text_tokens(entry), limit, "predict.prompt", "the prompt")
        if negative is not None:
            text_positions.check(text_tokens(neg), limit, "predict.negative_prompt", "the negative prompt")
        prompt_in = (entry["embed"], entry.get("image_mask"))
        latents = spec.family.sample(self.parts, prompt_in, negative, controls, size, options, progress=progress)
        if not bool(torch.isfinite(latents).all()):
            raise ModelLoadError(nonfinite_output(self.parts, "the sampled latents hold"))
        if output_type == "latent":
            return latents
        if nonfinite_weights(self.parts.vae):  # the VAE is small next to a sampling run: checked every time
            raise ModelLoadError(nonfinite_output(self.parts, "the decoded image would hold"))
        return spec.family.decode(self.parts.vae, latents, output_type=output_type)


def nonfinite_output(parts: Parts, what: str) -> str:
    """Why `what` holds NaN or infinite values: the first part (text encoder, transformer, VAE) whose weights do."""
    for name in ("text_encoder", "transformer", "vae"):
        module = getattr(parts, name, None)
        if isinstance(module, torch.nn.Module) and (bad := nonfinite_weights(module, frozen_only=False)):
            return f"{what} NaN or infinite values: {damaged_weights(name.replace('_', ' '), bad)}"
    return f"{what} NaN or infinite values: try model.dtype=float32 or another seed"


def open_images(images: Any, alpha: bool = False) -> list[Image.Image]:
    """Input images as RGB (RGBA with `alpha`, for a model that reads it): one image or a list of PIL images,
    numpy arrays (H, W, 3) and paths, or an array (N, H, W, 3) of N images."""
    if images is None:
        return []
    if isinstance(images, (str, Path, Image.Image)) or (isinstance(images, np.ndarray) and images.ndim < 4):
        images = [images]
    return [as_image(im, alpha) for im in images]


def build_predictor(model: ModelConfig, predict: PredictConfig, spec: ModelSpec) -> Predictor:
    """Build the parts of `model`'s pipeline on `predict.devices` (with `model.fuse_loras` fused) and the Predictor;
    loads `predict.lora`.

    Args:
        spec: the model's description, its checkpoint checked (`prepare_model`).

    Raises:
        ConfigError: a device that does not exist, a checkpoint that is not the configured model;
        ModelLoadError: a part or LoRA that cannot be loaded.
    """
    base, allow_other = fused_base(model, spec), predict.allow_other_base
    if predict.lora:  # before anything is built
        check_lora_base(predict.lora, base, allow_other)
    devices, swap = asdict(predict.devices), predict.blocks_to_swap
    device = resolve_device(devices["transformer"])
    if swap:  # built in CPU memory; the swapper moves all but the swapped blocks
        devices["transformer"] = "cpu"
    parts = load_parts(LoadSettings.of(model), spec, spec.part_names, devices, predict.compile, base.fuse_into)
    predictor = Predictor(parts, spec, base)
    if predict.lora:
        predictor.load_lora(predict.lora, predict.lora_scale, allow_other)
    if swap:
        predictor.swap_blocks(swap, device)
    if predict.compile:  # after the LoRA: the compiled block runs its layers
        from qie.runtime.compile import compile_blocks

        print(compile_blocks(predictor.parts.transformer, "predict.compile"))
    return predictor


def resolve_output(path: str, run_dir: Path) -> Path:
    """An output path: relative paths go inside the run directory, absolute ones stay."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else run_dir / p


def run(cfg: DictConfig, run_dir: Path) -> list[Path]:
    """Run inference (single image, or batch with `predict.input`) or the LoRA merge (`predict.merge_to`): the stage
    from code, `cfg` checked once (`qie.checks.check`), then `start`.

    Returns:
        The files written (images, or the merged transformer folder).

    Raises:
        QieError subclasses naming the key, file or device at fault.
    """
    return start(check(cfg), run_dir)


def start(checked: Checked, run_dir: Path) -> list[Path]:
    """The stage's edge: a checked config's typed groups handed to the `InferRecipe`. See `run`."""
    model, p = checked.groups.model, checked.groups.predict
    spec = prepare_model(model)  # first: a checkpoint of another model is named before anything else
    data = checked.groups.data if p.input else None
    return InferRecipe(model, p, spec, Path(run_dir), data).execute()


class InferRecipe(Recipe):
    """The infer stage: `setup()` checks the inputs (before the model is built) and builds the predictor, `run()`
    writes the outputs; a merge (`predict.merge_to`) does its work in `run()`.

    Args:
        data: the data group that reads `predict.input`'s rows (a batch run), else None.
    """

    def __init__(
        self, model: ModelConfig, predict: PredictConfig, spec: ModelSpec, run_dir: Path, data: DataConfig | None
    ) -> None:
        self.model, self.p, self.spec, self.run_dir, self.data = model, predict, spec, run_dir, data

    def setup(self) -> None:
        if self.p.merge_to:
            return
        self.options = sampling_options(self.p)
        checkpoint = pipeline_config(str(self.model.pretrained_model_name_or_path), self.model.revision)
        for note in self.spec.family.sampling_notes(self.spec, checkpoint, self.options):
            print(f"infer: warning: {note}")
        if self.data is None:
            self.images = self._input_images()  # a bad image fails before time is spent on building the model

    def run(self) -> list[Path]:
        model, p, spec, run_dir = self.model, self.p, self.spec, self.run_dir
        if p.merge_to:
            return [merge(model, p, run_dir, spec)]
        if self.data is not None:
            return run_batch(model, self.data, p, run_dir, spec)
        predictor = build_predictor(model, p, spec)
        made = predictor.predict(self.images, p.prompt, self.options, progress=True)
        written = spec.family.outputs.write(made, resolve_output(p.output, run_dir), int(p.num_images))
        for path in written:
            print(f"infer: wrote {path}")
        return written

    def _input_images(self) -> list[Image.Image]:
        """`predict.image(s)`, opened; ConfigError for no image where the model edits, no prompt, or a count of
        images the model does not take."""
        p, spec = self.p, self.spec
        sources = list(p.images) if p.images else ([p.image] if p.image else [])
        if not sources and spec.needs_controls:
            raise ConfigError(
                "no input image: set predict.image=FILE (predict.images=[A,B] for Edit-Plus, or predict.input=DATASET)"
            )
        if p.prompt is None:
            raise ConfigError(
                'no prompt: set predict.prompt="the instruction" (the image description for text to image)'
            )
        if problem := spec.control_problem(len(sources)):
            raise ConfigError(f"{len(sources)} input images given: {problem}")
        return open_images(sources, spec.family.alpha)


def run_batch(
    model: ModelConfig, data_settings: DataConfig, predict: PredictConfig, run_dir: Path, spec: ModelSpec
) -> list[Path]:
    """One output per row of the data set `predict.input` (read with the `data` group's settings), at
    `<output_dir>/<id>.png`; bad rows are reported."""
    data = read_data(data_source(data_settings, None, predict.input), require_target=False)
    out_dir = resolve_output(predict.output_dir, run_dir)
    predictor = build_predictor(model, predict, spec)
    options = sampling_options(predict)
    written: list[Path] = []
    failures = [f"{d.id}: {d.path}: {d.reason}" for d in data.problems]
    for sample in data.samples:
        try:
            images = predictor.predict(list(sample.controls), sample.prompt, options, progress=True)
        except QieError as e:  # one bad row must not stop the others
            failures.append(f"{sample.id}: {e}")
            continue
        outputs = spec.family.outputs  # <output_dir>/<id>.png, or a layered model's <output_dir>/<id>/layer_0.png...
        written += outputs.write(images, out_dir / outputs.row_path(_safe_relative(sample.id)), predict.num_images)
    print(f"infer: wrote {len(written)} image(s) for {len(data.samples)} row(s) to {out_dir}")
    for failure in failures:
        print(f"infer: skipped {failure}")
    return written


def _safe_relative(sample_id: str) -> Path:
    # Manifest ids may be paths; keep their folders but never let one climb out of output_dir.
    parts = [part for part in PurePosixPath(sample_id).parts if part not in ("", ".", "..", "/")]
    return Path(*parts) if parts else Path("sample")


def merge(model: ModelConfig, p: PredictConfig, run_dir: Path, spec: ModelSpec) -> Path:
    """Fuse `predict.lora` into the transformer (the LoRAs of `model.fuse_loras` fused first) and save it to
    `<merge_to>/transformer` (a config `qie.checks.validate` passed: it names a LoRA, the weights unquantized)."""
    base = fused_base(model, spec)
    if warning := check_lora_base(p.lora, base, bool(p.allow_other_base)):
        print(f"infer: warning: {warning}")
    parts = load_parts(
        LoadSettings.of(model), spec, ["transformer"], {"transformer": p.devices.transformer}, False, base.fuse_into
    )
    load_lora(parts.transformer, p.lora, float(p.lora_scale))
    out = save_transformer(merge_lora(parts.transformer), resolve_output(p.merge_to, run_dir))
    print(f"infer: merged {p.lora} (scale {p.lora_scale}) into the transformer, saved to {out}")
    return out
