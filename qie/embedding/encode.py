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
from qie.types import field_of_type

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
    # Each sample field's image by the field's name (`qie.data.fields`), like `target`: a preference pair's rejected
    # result is fields["rejected"].
    fields: dict[str, torch.Tensor] = field(default_factory=dict)


def prepare_sample(
    sample: Sample, sizes: ImageSizes, with_target: bool = True, with_controls: bool = True, with_fields: bool = True
) -> PreparedSample:
    """Read and resize a sample's images (the target, the controls, or both; its sample fields' images (a preference
    pair's rejected result) with the target unless not `with_fields`, see `prepare_field`).

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
        _check_like_target(layer, target, path, "layer", "its image")
        layers.append(layer)
    fields = {}
    if with_target and with_fields:
        fields = {name: prepare_field(sample, name, sizes, target) for name, _ in sample.field_images}
    pixels, vl = [], []
    for path in sample.controls if with_controls else ():
        vae_in, vl_in = condition_images(open_image(path, sizes.alpha), sizes.vae_image_pixels, sizes.vl_image_pixels)
        pixels.append(vae_in)
        vl.append(vl_in)
    return PreparedSample(sample, target, pixels, vl, layers, fields)


def prepare_field(sample: Sample, name: str, sizes: ImageSizes, target: torch.Tensor | None) -> torch.Tensor:
    """The image of the sample field `name` (a preference pair's rejected result: "rejected") read and resized as
    its (prepared) `target` is.

    Raises:
        ImageError: an unreadable image, or one of another size than `target` once resized.
        KeyError: the sample has no image of that field.
    """
    path = sample.fields[name]
    image = open_image(path, sizes.alpha)
    pixels = prepare_target(image, sizes.target_pixels, sizes.resize_mode, sizes.multiple_of)
    _check_like_target(pixels, target, path, f"{name} image", "its target")
    return pixels


def _check_like_target(pixels: torch.Tensor, target: torch.Tensor | None, path, what: str, other: str) -> None:
    """Raise ImageError when an image read as a target (a layer, a rejected result) has another size than the
    target once both are resized: they share one latent grid."""
    if target is not None and pixels.shape != target.shape:
        size, want = f"{pixels.shape[2]}x{pixels.shape[1]}", f"{target.shape[2]}x{target.shape[1]}"
        raise ImageError(path, f"{what} {str(path)!r} is {size} once resized, {other} {want}: make them one shape")


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
        self.pipeline = spec.family.pipeline(spec, parts)
        self._vae_channels_last: bool | None = None  # decided on the first batch of several images

    @torch.no_grad()
    def encode_latents(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """VAE latents of same-size images (C, H, W) in [-1, 1]: one normalised (C', 1, h, w) each."""
        batch = self._vae_layout(torch.stack(list(pixels)).unsqueeze(2))
        latents = self.spec.family.encode_latents(self.parts.vae, batch).contiguous()
        return [latent.cpu() for latent in latents.unbind(0)]

    def _vae_layout(self, batch: torch.Tensor) -> torch.Tensor:
        """`batch` in the memory layout the VAE encodes fastest: channels-last (N, D, H, W, C) for a batch of
        several images on the CPU, with the encoder's 3-D convolution weights turned channels-last once.

        On the CPU PyTorch runs a batch of several images through oneDNN, which is faster channels-last
        (it then needs no reorder around each convolution, and the VAE's RMS norm over channels reads
        contiguous memory); a single image goes to PyTorch's own convolution, which is faster as it is.
        Only the layout changes: values are those of the contiguous layout to float rounding.
        """
        vae = self.parts.vae
        if batch.shape[0] < 2 or batch.dim() != 5 or vae.device.type != "cpu":
            return batch
        if self._vae_channels_last is None:
            halves = [getattr(vae, name, None) for name in ("encoder", "quant_conv")]
            modules = (m for half in halves if half is not None for m in half.modules())
            convs = [m for m in modules if isinstance(m, torch.nn.Conv3d) and type(m.weight.data) is torch.Tensor]
            for conv in convs:
                conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last_3d)
            self._vae_channels_last = bool(convs)  # a VAE of 2-D convolutions is left as it is
        return batch.contiguous(memory_format=torch.channels_last_3d) if self._vae_channels_last else batch

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
        # Several samples: every image the VAE encodes (targets, controls, layers) in one list, so that images of
        # one size share a call, and the prompts with the empty prompts in one call. One sample: each type on its
        # own, so an image or prompt is encoded as the pipeline encodes it alone, whatever else the sample misses.
        together = len(prepared) > 1
        items: list[tuple[dict, str, torch.Tensor]] = []
        for kind in ("pixel_latent", "control_latent", "layer_latent", *(t for t in types if field_of_type(t))):
            if kind not in types:
                continue
            for i, p in enumerate(prepared):
                if images := _vae_inputs(p, kind):
                    out[i][kind] = {}
                    items += [(out[i][kind], name, t) for name, t in images.items()]
            if not together:
                self._fill_latents(items)
                items = []
        self._fill_latents(items)
        kinds = [k for k in ("prompt_embed", "empty_prompt_embed") if k in types]
        for group in [kinds] if together and kinds else [[k] for k in kinds]:
            prompts = [p.sample.prompt if k == "prompt_embed" else EMPTY_PROMPT for k in group for p in prepared]
            entries = self.encode_prompt_entries(prompts, [p.vl_images for _ in group for p in prepared])
            for j, entry in enumerate(entries):
                out[j % len(prepared)][group[j // len(prepared)]] = entry
        return out

    def _fill_latents(self, items: list[tuple[dict, str, torch.Tensor]]) -> None:
        """Encode (slots, name, pixels) items: slots[name] = the latent of pixels."""
        for (slots, name, _), latent in zip(items, self._latents_by_shape([t for _, _, t in items])):
            slots[name] = latent

    def _latents_by_shape(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Latents of images of any sizes, in their order: images of the same size are encoded in one batch."""
        groups: dict[tuple, list[int]] = {}
        for j, image in enumerate(pixels):
            groups.setdefault(tuple(image.shape), []).append(j)
        out: list[torch.Tensor] = [None] * len(pixels)  # type: ignore[list-item]
        for members in groups.values():
            for j, latent in zip(members, self.encode_latents([pixels[j] for j in members])):
                out[j] = latent
        return out


def prompt_limit(spec: ModelSpec, prepared: PreparedSample, sizes: ImageSizes) -> int:
    """The text tokens the transformer takes beside this sample's images (`ModelFamily.text_positions`): its
    target (with its layers) and its controls, as read; a target not read this time counts as a square of the
    configured area."""
    per_token = spec.family.planner.latent_pixels

    def frame(pixels: torch.Tensor) -> tuple[int, int, int]:
        return (1, int(pixels.shape[-2]) // per_token, int(pixels.shape[-1]) // per_token)

    side = int(sizes.target_pixels**0.5) // per_token
    target = (1, side, side) if prepared.target is None else frame(prepared.target)
    frames = [target] * (1 + len(prepared.layers)) + [frame(p) for p in prepared.control_pixels]
    return spec.family.text_positions(spec, frames)


def text_tokens(entry: dict[str, torch.Tensor]) -> int:
    """The text tokens of a prompt entry: its length less its image slots (a 2.1 prompt's)."""
    slots = entry.get("image_mask")
    return int(entry["embed"].shape[0]) - (0 if slots is None else int(slots.sum()))


def _vae_inputs(prepared: PreparedSample, kind: str) -> dict[str, torch.Tensor]:
    """The images of a latent entry type, by the name each latent has in the entry."""
    if kind == "pixel_latent" or (name := field_of_type(kind)) is not None:
        pixels = prepared.target if kind == "pixel_latent" else prepared.fields.get(name)
        return {} if pixels is None else {"latent": pixels}
    images = prepared.control_pixels if kind == "control_latent" else prepared.layers
    return {str(k): t for k, t in enumerate(images)}
