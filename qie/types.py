"""Plain data types shared across the library: cache type names, the schema version, a sample's
embeddings and a collated batch, and the one way prompt embeddings are padded.

A leaf module: it imports torch and, of qie, only the entry type names (`qie.entry_types`), so the training step,
the cache and the data code can all use these types without importing each other (or Hydra).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from qie.entry_types import (
    CACHE_TYPES,
    FIELD_TYPES,
    SCHEMA_VERSION,
    STORE_TYPES,
    TRAINING_TYPES,
    field_of_type,
    register_field_type,
    register_store_type,
)

# A prompt embedding as one (tokens, dim) tensor, or as pieces along the tokens (a prefix shared with other
# prompts of the same control images, then its own rows), joined only where one tensor is needed.
Embed = torch.Tensor | tuple[torch.Tensor, ...]


class SampleEmbeddings:
    """A sample's encoded inputs, on the CPU, unpadded.

    `pixel_latent` is None for a sample without a target (validation and inference inputs);
    `control_latents` is empty for a sample without control images. The prompt embeddings may be given as
    pieces (`Embed`): `prompt_embed` joins them on first use, collate copies the pieces into its batch.
    """

    def __init__(
        self,
        id: str,
        pixel_latent: torch.Tensor | None,  # (C, F, h, w), normalised; F = 1 + the target's layers
        control_latents: tuple[torch.Tensor, ...],  # each (C, 1, h, w), normalised
        prompt_embed: Embed,  # (tokens, dim)
        empty_prompt_embed: Embed,  # (tokens, dim), the same control images with the empty prompt
        cached: bool = False,  # read from the cache (True) or encoded for this call (False)
        # (tokens,) bool, True at the prompt's image slots: for models whose transformer places the control
        # latents there (Qwen-Image-2.1); None for the others.
        prompt_image_mask: torch.Tensor | None = None,
        empty_prompt_image_mask: torch.Tensor | None = None,
    ) -> None:
        self.id, self.pixel_latent, self.control_latents = id, pixel_latent, tuple(control_latents)
        self.prompt_pieces = _pieces(prompt_embed)
        self.empty_prompt_pieces = _pieces(empty_prompt_embed)
        self.cached = cached
        self.prompt_image_mask, self.empty_prompt_image_mask = prompt_image_mask, empty_prompt_image_mask
        # (1, 1, h, w) loss weights on the latent grid (a MaskedSource sets them); None: every pixel 1.
        self.loss_mask: torch.Tensor | None = None
        # Each sample field's encoded image by the field's name (`qie.data.fields`), (C, 1, h, w) like
        # `pixel_latent`: a preference pair's rejected result is `fields["rejected"]`.
        self.fields: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"SampleEmbeddings(id={self.id!r}, cached={self.cached})"

    @property
    def prompt_embed(self) -> torch.Tensor:
        if len(self.prompt_pieces) > 1:
            self.prompt_pieces = (torch.cat(self.prompt_pieces),)
        return self.prompt_pieces[0]

    @property
    def empty_prompt_embed(self) -> torch.Tensor:
        if len(self.empty_prompt_pieces) > 1:
            self.empty_prompt_pieces = (torch.cat(self.empty_prompt_pieces),)
        return self.empty_prompt_pieces[0]


def _pieces(embed: Embed) -> tuple[torch.Tensor, ...]:
    return tuple(embed) if isinstance(embed, (tuple, list)) else (embed,)


@dataclass(kw_only=True)
class Batch:
    """A collated batch. All samples share their latent shapes (buckets keep it so)."""

    ids: list[str]
    latents: torch.Tensor  # (B, C, F, h, w) normalised; F = 1 frame, or 1 + layers for a layered target
    control_latents: list[torch.Tensor]  # each (B, C, 1, h, w)
    prompt_embeds: torch.Tensor  # (B, L, D), zero-padded
    prompt_embeds_mask: torch.Tensor | None  # (B, L) 1/0, or None when nothing is padded
    prompt_image_mask: torch.Tensor | None = None  # (B, L) bool, False at padding (see SampleEmbeddings)
    # (B, 1, 1, h, w) float: a loss weight per latent pixel of the target (a loss mask), None: every pixel 1.
    loss_mask: torch.Tensor | None = None
    # The batch's loss is multiplied by this (regularisation batches: `data.regularization.weight`).
    loss_weight: float = 1.0
    # Each sample field's images by the field's name, (B, C, F, h, w) like `latents`: preference pairs' rejected
    # results are `fields["rejected"]` (`qie.data.fields`); empty: no field.
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    # Each sample's empty-prompt embedding, padded as `prompt_embeds` (with its masks): the negative branch of CFG,
    # carried only where the objective asks for it (distillation's teacher); None otherwise.
    negative_prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds_mask: torch.Tensor | None = None
    negative_prompt_image_mask: torch.Tensor | None = None

    def take(self, indices: Sequence[int]) -> Batch:
        """The batch of the samples at `indices`, in that order (their padding kept)."""
        index = list(indices)

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return Batch(
            ids=[self.ids[i] for i in index],
            latents=self.latents[index],
            control_latents=[c[index] for c in self.control_latents],
            prompt_embeds=self.prompt_embeds[index],
            prompt_embeds_mask=rows(self.prompt_embeds_mask),
            prompt_image_mask=rows(self.prompt_image_mask),
            loss_mask=rows(self.loss_mask),
            loss_weight=self.loss_weight,
            fields={name: t[index] for name, t in self.fields.items()},
            negative_prompt_embeds=rows(self.negative_prompt_embeds),
            negative_prompt_embeds_mask=rows(self.negative_prompt_embeds_mask),
            negative_prompt_image_mask=rows(self.negative_prompt_image_mask),
        )

    def to(self, device: torch.device, dtype: torch.dtype) -> Batch:
        if self._placed(torch.device(device), dtype):
            return self  # nothing to copy (a cached batch on the CPU in the model's dtype)
        mask = None if self.prompt_embeds_mask is None else self.prompt_embeds_mask.to(device)
        image_mask = None if self.prompt_image_mask is None else self.prompt_image_mask.to(device)
        loss_mask = None if self.loss_mask is None else self.loss_mask.to(device, torch.float32)

        def moved(t: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
            return None if t is None else t.to(device, dtype)

        return Batch(
            ids=self.ids,
            latents=self.latents.to(device, dtype),
            control_latents=[c.to(device, dtype) for c in self.control_latents],
            prompt_embeds=self.prompt_embeds.to(device, dtype),
            prompt_embeds_mask=mask,
            prompt_image_mask=image_mask,
            loss_mask=loss_mask,
            loss_weight=self.loss_weight,
            fields={name: t.to(device, dtype) for name, t in self.fields.items()},
            negative_prompt_embeds=moved(self.negative_prompt_embeds, dtype),
            negative_prompt_embeds_mask=moved(self.negative_prompt_embeds_mask),
            negative_prompt_image_mask=moved(self.negative_prompt_image_mask),
        )

    def _placed(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether `to(device, dtype)` would return equal tensors: every tensor on `device`, the floating ones
        in `dtype` (masks keep theirs; the loss mask is float32)."""
        floats = [self.latents, *self.control_latents, self.prompt_embeds]
        floats += [
            *self.fields.values(),
            *([self.negative_prompt_embeds] if self.negative_prompt_embeds is not None else []),
        ]
        others = [
            t
            for t in (
                self.prompt_embeds_mask,
                self.prompt_image_mask,
                self.negative_prompt_embeds_mask,
                self.negative_prompt_image_mask,
            )
            if t is not None
        ]
        if self.loss_mask is not None and self.loss_mask.dtype != torch.float32:
            return False
        return all(t.dtype == dtype for t in floats) and all(
            t.device == device for t in [*floats, *others, *([self.loss_mask] if self.loss_mask is not None else [])]
        )


def pad_prompt_embeds(embeds: Sequence[Embed]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack unpadded (tokens, dim) prompt embeddings (each a tensor or its pieces) into (B, L, dim),
    zero-padded at the end.

    Training batches and sampling inputs are padded by this one function, so the transformer sees the
    same inputs in both.

    Returns:
        The batch and its (B, L) long 1/0 mask, or None for the mask when nothing is padded: diffusers'
        `encode_prompt` drops an all-ones mask, and the transformer takes another attention path without
        one, so keeping it would change sampling results in the last bits.
    """
    pieces = [_pieces(e) for e in embeds]
    lengths = [sum(p.shape[0] for p in ps) for ps in pieces]
    first = pieces[0][0]
    batch = first.new_zeros(len(embeds), max(lengths), first.shape[1])
    mask = torch.zeros(len(embeds), max(lengths), dtype=torch.long)
    for i, ps in enumerate(pieces):
        row = 0
        for p in ps:
            batch[i, row : row + p.shape[0]] = p
            row += p.shape[0]
        mask[i, :row] = 1
    return batch, (None if bool(mask.all()) else mask)


def pad_image_masks(masks: Sequence[torch.Tensor | None], length: int) -> torch.Tensor | None:
    """Stack (tokens,) bool image-slot masks into (B, length), False at the padding `pad_prompt_embeds` adds;
    None when the samples have none."""
    if all(m is None for m in masks):
        return None
    if any(m is None for m in masks):
        raise ValueError("a batch mixes samples with and without a prompt image mask")
    out = torch.zeros(len(masks), length, dtype=torch.bool)
    for i, m in enumerate(masks):
        out[i, : m.shape[0]] = m
    return out


__all__ = [
    "CACHE_TYPES",
    "FIELD_TYPES",
    "SCHEMA_VERSION",
    "STORE_TYPES",
    "TRAINING_TYPES",
    "Batch",
    "Embed",
    "SampleEmbeddings",
    "field_of_type",
    "pad_image_masks",
    "pad_prompt_embeds",
    "register_field_type",
    "register_store_type",
]
