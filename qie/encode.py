"""Encoder: images and prompts to the tensors the transformer consumes, through diffusers' own code.

The Encoder holds a diffusers Edit / Edit-Plus pipeline object over whichever parts were built, and calls
its `_get_qwen_prompt_embeds` and `_encode_vae_image`, so cached values are the values the pipeline
computes. Latents come out normalised with the VAE's latents_mean / latents_std; prompt embeddings come
out unpadded, one (tokens, dim) tensor per prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from qie.components import Parts
from qie.data.images import condition_images, open_image, prepare_target
from qie.data.samples import Sample
from qie.models import model_spec

# The empty prompt stands in for a dropped caption and is the default negative prompt.
EMPTY_PROMPT = ""


@dataclass(frozen=True)
class ImageSizes:
    """The areas images are resized to: target, and control images for the VAE and for Qwen2.5-VL."""

    target_pixels: int
    vae_image_pixels: int
    vl_image_pixels: int
    resize_mode: str = "resize"
    multiple_of: int = 32


@dataclass
class PreparedSample:
    """A sample's images, resized and normalised, ready for the encoders."""

    sample: Sample
    target: torch.Tensor | None  # (3, H, W) in [-1, 1]
    control_pixels: list[torch.Tensor]  # each (3, H, W) in [-1, 1]
    vl_images: list[Image.Image]


def prepare_sample(
    sample: Sample, sizes: ImageSizes, with_target: bool = True, with_controls: bool = True
) -> PreparedSample:
    """Read and resize a sample's images (the target, the controls, or both).

    Raises:
        ImageError (a DataError): naming the unreadable file in its message and in `.path`.
    """
    target = None
    if with_target and sample.target is not None:
        target = prepare_target(open_image(sample.target), sizes.target_pixels, sizes.resize_mode, sizes.multiple_of)
    pixels, vl = [], []
    for path in sample.controls if with_controls else ():
        vae_in, vl_in = condition_images(open_image(path), sizes.vae_image_pixels, sizes.vl_image_pixels)
        pixels.append(vae_in)
        vl.append(vl_in)
    return PreparedSample(sample, target, pixels, vl)


class Encoder:
    """Computes latents and prompt embeddings with the VAE encoder and Qwen2.5-VL of `parts`.

    Results are returned on the CPU, whatever device the encoders run on.

    Args:
        parts: built parts; `vae` for latents, `text_encoder` + `processor` (+ `tokenizer`) for prompts.
        variant: "edit" or "edit_plus": picks the pipeline whose prompt template and image handling apply.
    """

    def __init__(self, parts: Parts, variant: str) -> None:
        self.parts = parts
        self.variant = variant
        self.spec = model_spec(variant)
        self.pipeline = self.spec.pipeline(parts)

    @torch.no_grad()
    def encode_latents(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """VAE latents of same-size images (3, H, W) in [-1, 1]: one normalised (C, 1, h, w) each."""
        vae = self.parts.vae
        batch = torch.stack(list(pixels)).unsqueeze(2).to(vae.device, vae.dtype)
        latents = self.pipeline._encode_vae_image(batch, generator=None)
        return [latent.cpu() for latent in latents.unbind(0)]

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], images: Sequence[Sequence[Image.Image]]) -> list[torch.Tensor]:
        """Prompt embeddings, each (tokens, dim) without padding, of prompts seen with their control images.

        Edit prompts (one image each) are encoded as one batch; Edit-Plus prompts one at a time, as
        diffusers' multi-image prompt applies one image list to every prompt of a call.
        """
        counts = [len(imgs) for imgs in images]
        if (
            len(counts) != len(prompts)
            or 0 in counts
            or (not self.spec.multi_image_prompt and max(counts, default=1) > 1)
        ):
            raise ValueError(
                f"{len(prompts)} prompts with {counts} control images each: every prompt needs its images, and "
                f"the Edit pipeline's prompt takes one image (Edit-Plus takes several)"
            )
        device = self.parts.text_encoder.device
        if self.spec.multi_image_prompt:
            out = []
            for prompt, imgs in zip(prompts, images):
                out += self._encode([prompt], list(imgs), device)
            return out
        return self._encode(list(prompts), [imgs[0] for imgs in images], device)

    def _encode(self, prompts: list[str], images: list[Image.Image], device: torch.device) -> list[torch.Tensor]:
        embeds, mask = self.pipeline._get_qwen_prompt_embeds(prompt=prompts, image=images, device=device)
        lengths = mask.sum(dim=1).tolist()
        return [e[:n].cpu().clone() for e, n in zip(embeds, lengths)]

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
        if "control_latent" in types:
            items = [(i, k, t) for i, p in enumerate(prepared) for k, t in enumerate(p.control_pixels)]
            for (i, k), latent in self._latents_by_shape(items):
                out[i].setdefault("control_latent", {})[str(k)] = latent
        for kind, prompt_of in (("prompt_embed", lambda p: p.sample.prompt), ("empty_prompt_embed", None)):
            mask_kind = kind.replace("embed", "embeds_mask")
            if kind not in types and mask_kind not in types:
                continue
            prompts = [prompt_of(p) if prompt_of else EMPTY_PROMPT for p in prepared]
            for i, embed in enumerate(self.encode_prompts(prompts, [p.vl_images for p in prepared])):
                out[i][kind] = {"embed": embed}
                out[i][mask_kind] = {"mask": torch.ones(embed.shape[0], dtype=torch.long)}
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
