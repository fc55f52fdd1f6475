"""Encoder: images and prompts to the tensors the transformer consumes, through the model family's pieces.

The Encoder holds the model's diffusers pipeline object over whichever parts were built and hands it to the
family's `encode_prompts` and `encode_latents` (`qie.models.family`), so cached values are the values the
pipeline computes. Latents come out normalised with the VAE's latents_mean / latents_std; prompt embeddings
come out unpadded, one (tokens, dim) tensor per prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from PIL import Image

from qie.components import Parts
from qie.data.images import ImageError, condition_images, open_image, prepare_target
from qie.data.samples import Sample
from qie.models import ModelSpec

# The empty prompt stands in for a dropped caption and is the default negative prompt.
EMPTY_PROMPT = ""


@dataclass(frozen=True)
class ImageSizes:
    """The areas images are resized to: target, and control images for the VAE and for the VL encoder."""

    target_pixels: int
    vae_image_pixels: int
    vl_image_pixels: int
    resize_mode: str = "resize"
    multiple_of: int = 32
    # Keep the images' alpha channel (an RGBA VAE: Qwen-Image-2.1); else alpha is composited on white.
    alpha: bool = False


@dataclass
class PreparedSample:
    """A sample's images, resized and normalised, ready for the encoders."""

    sample: Sample
    target: torch.Tensor | None  # (3, H, W) in [-1, 1]; (4, H, W) with ImageSizes.alpha
    control_pixels: list[torch.Tensor]  # each (3 or 4, H, W) in [-1, 1]
    vl_images: list[Image.Image]
    layers: list[torch.Tensor] = field(default_factory=list)  # the target's further frames, like `target`


def prepare_sample(
    sample: Sample, sizes: ImageSizes, with_target: bool = True, with_controls: bool = True
) -> PreparedSample:
    """Read and resize a sample's images (the target, the controls, or both).

    Raises:
        ImageError (a DataError): naming the unreadable file in its message and in `.path`.
    """
    target = None
    if with_target and sample.target is not None:
        image = open_image(sample.target, sizes.alpha)
        target = prepare_target(image, sizes.target_pixels, sizes.resize_mode, sizes.multiple_of)
    layers = []
    for path in sample.layers if with_target else ():
        layer = prepare_target(open_image(path, sizes.alpha), sizes.target_pixels, sizes.resize_mode, sizes.multiple_of)
        if target is not None and layer.shape != target.shape:
            size, want = f"{layer.shape[2]}x{layer.shape[1]}", f"{target.shape[2]}x{target.shape[1]}"
            raise ImageError(path, f"layer {str(path)!r} is {size} once resized, its image {want}: make them one size")
        layers.append(layer)
    pixels, vl = [], []
    for path in sample.controls if with_controls else ():
        vae_in, vl_in = condition_images(open_image(path, sizes.alpha), sizes.vae_image_pixels, sizes.vl_image_pixels)
        pixels.append(vae_in)
        vl.append(vl_in)
    return PreparedSample(sample, target, pixels, vl, layers)


class Encoder:
    """Computes latents and prompt embeddings with the VAE encoder and the vision-language model of `parts`.

    Results are returned on the CPU, whatever device the encoders run on.

    Args:
        parts: built parts; `vae` for latents, `text_encoder` + the spec's `prompt_parts` for prompts.
        spec: the model description: its pipeline's prompt template and how prompts see their images.
    """

    def __init__(self, parts: Parts, spec: ModelSpec) -> None:
        self.parts = parts
        self.spec = spec
        self.pipeline = spec.pipeline(parts)

    @torch.no_grad()
    def encode_latents(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """VAE latents of same-size images (C, H, W) in [-1, 1]: one normalised (C', 1, h, w) each."""
        latents = self.spec.family.encode_latents(self.parts.vae, torch.stack(list(pixels)).unsqueeze(2))
        return [latent.cpu() for latent in latents.unbind(0)]

    def encode_prompts(self, prompts: Sequence[str], images: Sequence[Sequence[Image.Image]]) -> list[torch.Tensor]:
        """Prompt embeddings, each (tokens, dim) without padding (see `encode_prompt_entries`)."""
        return [entry["embed"] for entry in self.encode_prompt_entries(prompts, images)]

    @torch.no_grad()
    def encode_prompt_entries(
        self, prompts: Sequence[str], images: Sequence[Sequence[Image.Image]]
    ) -> list[dict[str, torch.Tensor]]:
        """Prompts seen with their control images, as cache entries: "embed" (tokens, dim) without padding,
        and for a family whose transformer places the control latents in the prompt (2.1) "image_mask"
        (tokens,) bool, True at the image slots. How prompts are batched is the family's
        (`ModelFamily.encode_prompts`).

        Raises:
            ValueError: a prompt with a number of images the model's prompt cannot take.
        """
        counts = [len(imgs) for imgs in images]
        bad = [self.spec.control_problem(n) for n in counts]
        if len(counts) != len(prompts) or any(bad):
            raise ValueError(
                f"{len(prompts)} prompts with {counts} control images each: every prompt needs its images "
                f"({next((b for b in bad if b), 'one list of images per prompt')})"
            )
        device = self.parts.text_encoder.device
        return self.spec.family.encode_prompts(self.pipeline, self.spec, list(prompts), list(images), device)

    def encode_entries(self, prepared: Sequence[PreparedSample], types: Sequence[str]) -> list[dict]:
        """Cache entries of the given types for each prepared sample, computed in batches.

        Returns:
            One dict per sample: type name -> entry (a dict of named tensors), as the cache stores it.
        """
        out: list[dict] = [{} for _ in prepared]
        if "pixel_latent" in types:
            items = [(i, 0, p.target) for i, p in enumerate(prepared) if p.target is not None]
            for (i, _), latent in self._latents_by_shape(items):
                out[i]["pixel_latent"] = {"latent": latent}
        for kind, pixels_of in (("control_latent", lambda p: p.control_pixels), ("layer_latent", lambda p: p.layers)):
            if kind in types:
                items = [(i, k, t) for i, p in enumerate(prepared) for k, t in enumerate(pixels_of(p))]
                for (i, k), latent in self._latents_by_shape(items):
                    out[i].setdefault(kind, {})[str(k)] = latent
        for kind, prompt_of in (("prompt_embed", lambda p: p.sample.prompt), ("empty_prompt_embed", None)):
            if kind not in types:
                continue
            prompts = [prompt_of(p) if prompt_of else EMPTY_PROMPT for p in prepared]
            for i, entry in enumerate(self.encode_prompt_entries(prompts, [p.vl_images for p in prepared])):
                out[i][kind] = entry
        return out

    def _latents_by_shape(self, items: list[tuple[int, int, torch.Tensor]]):
        """Encode (sample, slot, pixels) items, batching images of the same size together."""
        groups: dict[tuple, list] = {}
        for i, k, pixels in items:
            groups.setdefault(tuple(pixels.shape), []).append((i, k, pixels))
        for group in groups.values():
            latents = self.encode_latents([p for _, _, p in group])
            for (i, k, _), latent in zip(group, latents):
                yield (i, k), latent
