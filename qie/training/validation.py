"""Validation during training: fixed inputs, fixed seeds, the sampling code inference uses.

Inputs arrive encoded (SampleEmbeddings; a target latent only where it sets the output size), so
validation in cached mode needs only the transformer, the scheduler and the VAE decoder. Each
validation step writes its images to `<run>/validation/step-NNNNNN/<id>.png` (whatever the tracker),
and, for inputs whose target image is known, edit-aware metrics (`qie.evaluation.image_metrics`) to
`validation/metrics.jsonl` and the tracker.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from PIL import Image

from qie.components.registry import Parts
from qie.data.images import open_image
from qie.evaluation.image_metrics import edit_metrics
from qie.models import ModelSpec
from qie.models.sampling import SamplingOptions, latent_sizes
from qie.training.logging import MetricsLogger
from qie.types import SampleEmbeddings

METRICS_FILE = "metrics.jsonl"
# Per validation image (its file name's stem): the prompt and the input images it was sampled from.
INPUTS_FILE = "inputs.json"


@dataclass(frozen=True)
class Reference:
    """What an output is measured against: the input's control image (the one the output's size follows)
    and, when known, its target; and the prompt it was sampled with (recorded beside the images)."""

    control: Path | None = None
    target: Path | None = None
    prompt: str = ""


class Validator:
    """Samples each input with the current transformer; saves, measures and logs the images.

    Args:
        inputs: encoded validation inputs; `negatives[i]` is input i's negative prompt as (embedding, image
            mask or None), or None.
        scheduler, vae: the model's scheduler and VAE (only its decoder is used).
        options: sampling options (fields left None take the model's defaults); input i is sampled with
            seed `options.seed + i`.
        spec: the model description, whose `output_size` rule sizes each output (from the options, the
            input's control images, or its target's size when it has no control image), and whose sampler
            and decoder make the images.
        out_dir: where `step-NNNNNN/<id>.png` and metrics.jsonl go (None: nowhere).
        references: per input, the images its metrics compare with (no metrics without a target).
        pipeline_config: the checkpoint's model_index.json (`Parts.pipeline_config`).
        tag: the tracker's name for the images, and the prefix of the metrics' names.
    """

    def __init__(
        self,
        inputs: list[SampleEmbeddings],
        negatives: list[tuple[torch.Tensor, torch.Tensor | None] | None],
        scheduler,
        vae,
        logger: MetricsLogger | None,
        options: SamplingOptions,
        spec: ModelSpec,
        out_dir: Path | None = None,
        references: list[Reference] | None = None,
        pipeline_config: dict | None = None,
        tag: str = "validation",
    ) -> None:
        self.inputs, self.negatives, self.scheduler, self.vae = inputs, negatives, scheduler, vae
        self.logger, self.options, self.spec = logger, options.resolved(spec.call_defaults()), spec
        self.pipeline_config = pipeline_config or {}
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.references = references or [Reference() for _ in inputs]
        self.tag = tag

    @torch.no_grad()
    def sample(self, transformer: torch.nn.Module) -> list[list[Image.Image]]:
        """Per input, its `options.num_images` images."""
        f = self.spec.family.vae_scale(self.vae)
        out = []
        was_training = transformer.training
        transformer.eval()
        for n, (item, negative) in enumerate(zip(self.inputs, self.negatives)):
            options = replace(self.options, seed=self.options.seed + n)
            target = latent_sizes([item.pixel_latent], f)[0] if item.pixel_latent is not None else None
            size = self.spec.output_size(
                options.height, options.width, latent_sizes(item.control_latents, f), target, f
            )
            parts = Parts(vae=self.vae, transformer=transformer, scheduler=self.scheduler)
            parts.pipeline_config = self.pipeline_config
            prompt = (item.prompt_embed, item.prompt_image_mask)
            latents = self.spec.family.sample(parts, prompt, negative, item.control_latents, size, options)
            out.append(self.spec.family.decode(self.vae, latents))
        transformer.train(was_training)
        return out

    def images(self, transformer: torch.nn.Module) -> list[Image.Image]:
        """Every input's images, in one list."""
        return [image for images in self.sample(transformer) for image in images]

    def __call__(self, step: int, transformer: torch.nn.Module) -> list[Image.Image]:
        per_input = self.sample(transformer)
        images = [image for group in per_input for image in group]
        if self.out_dir is not None:
            self.save(step, per_input)
        metrics = self.measure(per_input)
        if metrics is not None and self.out_dir is not None:
            with open(self.out_dir / METRICS_FILE, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.logger is not None:
            self.logger.log_images(self.tag, images, step)
            if metrics is not None:
                self.logger.log_scalars({f"{self.tag}/{k}": v for k, v in metrics["mean"].items()}, step)
        return images

    def save(self, step: int, per_input: list[list[Image.Image]]) -> Path:
        """Write `step-NNNNNN/<id>.png` (`<id>_<k>.png` for several images per input), and `inputs.json`: per
        `<id>`, the prompt, control image and target the images were sampled for."""
        folder = self.out_dir / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        inputs = {
            file_name(item.id): {
                "prompt": ref.prompt,
                "control": ref.control and str(ref.control),
                "target": ref.target and str(ref.target),
            }
            for item, ref in zip(self.inputs, self.references)
        }
        (self.out_dir / INPUTS_FILE).write_text(json.dumps(inputs, indent=2), encoding="utf-8")
        for item, images in zip(self.inputs, per_input):
            name = file_name(item.id)
            for k, image in enumerate(images):
                image.save(folder / (f"{name}.png" if len(images) == 1 else f"{name}_{k}.png"))
        return folder

    def measure(self, per_input: list[list[Image.Image]]) -> dict | None:
        """Edit metrics per input that has a target (first image of each), and their means; None if none has."""
        samples = {}
        for item, images, ref in zip(self.inputs, per_input, self.references):
            if ref.target is None or ref.control is None or not images:
                continue
            samples[item.id] = edit_metrics(images[0], open_image(ref.control), open_image(ref.target))
        if not samples:
            return None
        names = next(iter(samples.values())).keys()
        mean = {}
        for name in names:
            values = [m[name] for m in samples.values() if not math.isnan(m[name])]
            if values:
                mean[name] = sum(values) / len(values)
        return {"mean": mean, "samples": samples}


def file_name(sample_id: str) -> str:
    """A sample id as a plain file name (manifest ids may be paths)."""
    return re.sub(r"[^\w.-]+", "_", sample_id).strip("._") or "sample"
