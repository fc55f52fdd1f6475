"""Held-out loss with fixed noise and fixed noise levels: comparable across checkpoints and runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from qie.data.collate import collate
from qie.data.samples import Sample
from qie.embeddings import EmbeddingSource

DEFAULT_SIGMAS = (0.2, 0.4, 0.6, 0.8)


@torch.no_grad()
def heldout_loss(
    transformer: torch.nn.Module,
    source: EmbeddingSource,
    samples: Sequence[Sample],
    loss: Callable[..., torch.Tensor],
    seed: int = 0,
    sigmas: Sequence[float] = DEFAULT_SIGMAS,
) -> float:
    """Mean flow-matching loss over samples x sigmas, each sample with its own fixed noise.

    The transformer's device and dtype are used for the computation; `loss` is the model family's.
    """
    param = next(transformer.parameters())
    device, dtype = param.device, param.dtype
    was_training = transformer.training
    transformer.eval()
    total, count = 0.0, 0
    for i, sample in enumerate(samples):
        batch = collate(source.get([sample])).to(device, dtype)
        g = torch.Generator().manual_seed(seed * 100_003 + i)
        noise = torch.randn(batch.latents.shape, generator=g).to(device, dtype)
        for sigma in sigmas:
            s = torch.full((1,), float(sigma))
            total += loss(transformer, batch, noise, s, "none").item()
            count += 1
    transformer.train(was_training)
    return total / max(count, 1)
