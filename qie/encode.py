"""Encoder: images and prompts to the tensors the transformer consumes, through diffusers' own code.

The Encoder holds the model's diffusers pipeline object (Edit, Edit-Plus or text-to-image) over whichever
parts were built, and calls its `_get_qwen_prompt_embeds` and `_encode_vae_image`, so cached values are the
values the pipeline computes (images are VAE-encoded as the Edit pipelines do: the text-to-image pipeline
encodes none, and every Qwen-Image model shares the VAE). Latents come out normalised with the VAE's
latents_mean / latents_std; prompt embeddings come out unpadded, one (tokens, dim) tensor per prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from diffusers import QwenImageEditPipeline
from PIL import Image

from qie.components import Parts
from qie.data.images import condition_images, open_image, prepare_target
from qie.data.samples import Sample
from qie.models import ModelSpec

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
    # Keep the images' alpha channel (an RGBA VAE: Qwen-Image-2.1); else alpha is composited on white.
    alpha: bool = False


@dataclass
class PreparedSample:
    """A sample's images, resized and normalised, ready for the encoders."""

    sample: Sample
    target: torch.Tensor | None  # (3, H, W) in [-1, 1]; (4, H, W) with ImageSizes.alpha
    control_pixels: list[torch.Tensor]  # each (3 or 4, H, W) in [-1, 1]
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
        image = open_image(sample.target, sizes.alpha)
        target = prepare_target(image, sizes.target_pixels, sizes.resize_mode, sizes.multiple_of)
    pixels, vl = [], []
    for path in sample.controls if with_controls else ():
        vae_in, vl_in = condition_images(open_image(path, sizes.alpha), sizes.vae_image_pixels, sizes.vl_image_pixels)
        pixels.append(vae_in)
        vl.append(vl_in)
    return PreparedSample(sample, target, pixels, vl)


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
        self.vae_pipeline = QwenImageEditPipeline(
            scheduler=None, vae=parts.vae, text_encoder=None, tokenizer=None, processor=None, transformer=None
        )

    @torch.no_grad()
    def encode_latents(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """VAE latents of same-size images (3, H, W) in [-1, 1]: one normalised (C, 1, h, w) each."""
        vae = self.parts.vae
        batch = torch.stack(list(pixels)).unsqueeze(2).to(vae.device, vae.dtype)
        latents = self.vae_pipeline._encode_vae_image(batch, generator=None)
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
        (tokens,) bool, True at the image slots.

        A family with its own prompt encoder (`ModelSpec.prompt_encoder`) encodes one prompt per call.
        Prompts without images (text-to-image, or an Edit-Plus sample without a control image: the
        pipeline's text-only prompt) and Edit prompts (one image each) are encoded in batches; Edit-Plus
        prompts with images one at a time, as diffusers' multi-image prompt applies one image list to
        every prompt of a call.

        Raises:
            ValueError: a prompt with a number of images the model's prompt cannot take.
        """
        counts = [len(imgs) for imgs in images]
        bad = [self.spec.control_problem(n) for n in counts]
        if len(counts) != len(prompts) or any(bad):
            raise ValueError(
                f"{len(prompts)} prompts with {counts} control images each: every prompt needs its images, "
                f"and the Edit pipeline's prompt takes one image (Edit-Plus takes several): "
                f"{next((b for b in bad if b), '')}"
            )
        device = self.parts.text_encoder.device
        encode_one = self.spec.prompt_encoder
        if encode_one is not None:
            return [encode_one(self.pipeline, p, list(imgs), device) for p, imgs in zip(prompts, images)]
        if self.spec.family.prompt_images == "one":  # Edit: one image per prompt, one batch
            return [{"embed": e} for e in self._encode(list(prompts), [imgs[0] for imgs in images], device)]
        out: list[torch.Tensor | None] = [None] * len(prompts)
        text_only = [i for i, n in enumerate(counts) if n == 0]
        if text_only:
            for i, embed in zip(text_only, self._encode([prompts[i] for i in text_only], None, device)):
                out[i] = embed
        for i in (i for i, n in enumerate(counts) if n):
            (out[i],) = self._encode([prompts[i]], list(images[i]), device)
        return [{"embed": embed} for embed in out]

    def _encode(self, prompts: list[str], images: list[Image.Image] | None, device: torch.device) -> list[torch.Tensor]:
        # The text-to-image pipeline takes no `image`; an Edit-Plus prompt without one is its text-only prompt.
        kwargs = {} if images is None else {"image": images}
        embeds, mask = self.pipeline._get_qwen_prompt_embeds(prompt=prompts, device=device, **kwargs)
        cut = self.spec.family.max_prompt_tokens  # where the pipeline's __call__ cuts prompt embeddings
        return [e[: min(int(n), cut or int(n))].cpu().clone() for e, n in zip(embeds, mask.sum(dim=1).tolist())]

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
            for i, entry in enumerate(self.encode_prompt_entries(prompts, [p.vl_images for p in prepared])):
                out[i][kind] = entry
                out[i][mask_kind] = {"mask": torch.ones(entry["embed"].shape[0], dtype=torch.long)}
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
