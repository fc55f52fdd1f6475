"""Collate: stack latents, pad prompt embeddings to the batch's longest with a 0/1 mask."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qie.embeddings import SampleEmbeddings


@dataclass
class Batch:
    """A collated batch. All samples share their latent shapes (buckets keep it so)."""

    ids: list[str]
    latents: torch.Tensor  # (B, C, 1, h, w) normalised
    control_latents: list[torch.Tensor]  # each (B, C, 1, h, w)
    prompt_embeds: torch.Tensor  # (B, L, D), zero-padded
    prompt_embeds_mask: torch.Tensor  # (B, L), 1 for tokens, 0 for padding
    cached: list[bool]

    def to(self, device: torch.device, dtype: torch.dtype) -> Batch:
        return Batch(
            self.ids,
            self.latents.to(device, dtype),
            [c.to(device, dtype) for c in self.control_latents],
            self.prompt_embeds.to(device, dtype),
            self.prompt_embeds_mask.to(device),
            self.cached,
        )


def pad_embeds(embeds: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens_i, D) tensors -> (B, L, D) zero-padded and the (B, L) long mask."""
    length = max(e.shape[0] for e in embeds)
    out = embeds[0].new_zeros(len(embeds), length, embeds[0].shape[1])
    mask = torch.zeros(len(embeds), length, dtype=torch.long)
    for i, e in enumerate(embeds):
        out[i, : e.shape[0]] = e
        mask[i, : e.shape[0]] = 1
    return out, mask


def collate(items: Sequence[SampleEmbeddings], drop_caption: Sequence[bool] | None = None) -> Batch:
    """Batch samples; where `drop_caption[i]`, sample i's empty-prompt embedding replaces its prompt's.

    Raises:
        ValueError: samples whose latent shapes differ (they cannot share rotary positions).
    """
    drop = list(drop_caption) if drop_caption is not None else [False] * len(items)
    shapes = {(tuple(s.pixel_latent.shape), tuple(tuple(c.shape) for c in s.control_latents)) for s in items}
    if len(shapes) > 1:
        raise ValueError(f"a batch mixes latent shapes {sorted(shapes)}: batch by bucket (see qie.data.buckets)")
    embeds, mask = pad_embeds([s.empty_prompt_embed if d else s.prompt_embed for s, d in zip(items, drop)])
    n_controls = len(items[0].control_latents)
    return Batch(
        ids=[s.id for s in items],
        latents=torch.stack([s.pixel_latent for s in items]),
        control_latents=[torch.stack([s.control_latents[k] for s in items]) for k in range(n_controls)],
        prompt_embeds=embeds,
        prompt_embeds_mask=mask,
        cached=[s.cached for s in items],
    )
