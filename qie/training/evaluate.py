"""Held-out measures with fixed noise and fixed noise levels: comparable across checkpoints and runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from qie.data.collate import collate
from qie.data.samples import Sample
from qie.embedding.sources import EmbeddingSource

DEFAULT_SIGMAS = (0.2, 0.4, 0.6, 0.8)
# (transformer, batch, noise, sigmas) -> named measures of the batch ("loss" among them)
Evaluate = Callable[..., dict[str, float]]


@torch.no_grad()
def heldout_metrics(
    transformer: torch.nn.Module,
    source: EmbeddingSource,
    samples: Sequence[Sample],
    evaluate: Evaluate,
    seed: int = 0,
    sigmas: Sequence[float] = DEFAULT_SIGMAS,
    negatives: bool = False,
) -> dict[str, float]:
    """Each measure of `evaluate` (an objective's), averaged over samples x sigmas, each sample with its own fixed
    noise. The transformer's device and dtype are used for the computation. `negatives`: the batches carry the
    samples' empty-prompt embeddings (an objective that asks for them, `collate`)."""
    param = next(transformer.parameters())
    device, dtype = param.device, param.dtype
    was_training = transformer.training
    transformer.eval()
    totals: dict[str, float] = {}
    count = 0
    for i, sample in enumerate(samples):
        batch = collate(source.get([sample]), negatives=negatives).to(device, dtype)
        g = torch.Generator().manual_seed(seed * 100_003 + i)
        noise = torch.randn(batch.latents.shape, generator=g).to(device, dtype)
        for sigma in sigmas:
            for name, value in evaluate(transformer, batch, noise, torch.full((1,), float(sigma))).items():
                totals[name] = totals.get(name, 0.0) + value
            count += 1
    transformer.train(was_training)
    return {name: total / max(count, 1) for name, total in totals.items()}


def heldout_loss(
    transformer: torch.nn.Module,
    source: EmbeddingSource,
    samples: Sequence[Sample],
    loss: Callable[..., torch.Tensor],
    seed: int = 0,
    sigmas: Sequence[float] = DEFAULT_SIGMAS,
) -> float:
    """Mean flow-matching loss over samples x sigmas, each sample with its own fixed noise (`heldout_metrics` of
    the model family's `loss`)."""

    def evaluate(model: torch.nn.Module, batch, noise: torch.Tensor, s: torch.Tensor) -> dict[str, float]:
        return {"loss": loss(model, batch, noise, s, "none").item()}

    return heldout_metrics(transformer, source, samples, evaluate, seed, sigmas).get("loss", 0.0)
