"""Collate: stack latents (and the sample fields' ones: preference pairs' rejected results) and loss masks, pad
prompt embeddings to the batch's longest (`pad_prompt_embeds`). A batch of samples without targets (an objective
that samples its own results, `train/objective=grpo`) holds zeros as its latents, shaped as the output's: its last
control image's latents (the output image of every edit family: Edit's one, Edit-Plus' and 2.1's last)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qie.types import Batch, SampleEmbeddings, pad_image_masks, pad_prompt_embeds


def collate(
    items: Sequence[SampleEmbeddings], drop_caption: Sequence[bool] | None = None, negatives: bool = False
) -> Batch:
    """Batch samples; where `drop_caption[i]`, sample i's empty-prompt embedding replaces its prompt's. With
    `negatives`, each sample's empty-prompt embedding is padded beside them (`Batch.negative_prompt_embeds`).

    Raises:
        ValueError: samples whose latent shapes differ (they cannot share rotary positions), a batch that mixes
            samples with and without targets, or a sample with neither a target nor a control image.
    """
    drop = list(drop_caption) if drop_caption is not None else [False] * len(items)
    latents = [s.pixel_latent for s in items]
    if any(x is None for x in latents):
        if not all(x is None for x in latents) or not all(s.control_latents for s in items):
            raise ValueError(
                f"samples {[s.id for s in items if s.pixel_latent is None]} have no target latent "
                "(and no control image to take the output's size from, or others in the batch have)"
            )
        latents = [torch.zeros_like(s.control_latents[-1]) for s in items]
    shapes = {(tuple(x.shape), tuple(tuple(c.shape) for c in s.control_latents)) for x, s in zip(latents, items)}
    if len(shapes) > 1:
        raise ValueError(f"a batch mixes latent shapes {sorted(shapes)}: batch by bucket (see qie.data.buckets)")
    embeds, mask = pad_prompt_embeds([s.empty_prompt_pieces if d else s.prompt_pieces for s, d in zip(items, drop)])
    image_masks = [s.empty_prompt_image_mask if d else s.prompt_image_mask for s, d in zip(items, drop)]
    n_controls = len(items[0].control_latents)
    loss_mask, fields = None, {}
    for name in dict.fromkeys(name for s in items for name in s.fields):  # in the order the samples give them
        if any(name not in s.fields for s in items):
            lacking = [s.id for s in items if name not in s.fields]
            raise ValueError(f"samples {lacking} have no {name} latent beside samples that have one")
        fields[name] = torch.stack([s.fields[name] for s in items])
    if any(s.loss_mask is not None for s in items):
        ones = torch.ones(1, 1, *latents[0].shape[-2:])
        loss_mask = torch.stack([s.loss_mask if s.loss_mask is not None else ones for s in items])
    negative = negative_mask = negative_image_mask = None
    if negatives:
        negative, negative_mask = pad_prompt_embeds([s.empty_prompt_pieces for s in items])
        negative_image_mask = pad_image_masks([s.empty_prompt_image_mask for s in items], negative.shape[1])
    return Batch(
        ids=[s.id for s in items],
        latents=torch.stack(latents),
        control_latents=[torch.stack([s.control_latents[k] for s in items]) for k in range(n_controls)],
        prompt_embeds=embeds,
        prompt_embeds_mask=mask,
        prompt_image_mask=pad_image_masks(image_masks, embeds.shape[1]),
        loss_mask=loss_mask,
        fields=fields,
        negative_prompt_embeds=negative,
        negative_prompt_embeds_mask=negative_mask,
        negative_prompt_image_mask=negative_image_mask,
    )
