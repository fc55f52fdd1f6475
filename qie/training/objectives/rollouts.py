"""What the online-RL objectives (GRPO, NFT) share about their rollouts: the shape they are sampled at
(`rollout_pixels`), and scoring each group's edits while the next group samples (`Scoring`), with the time each side
took (`rollout_seconds`, `reward_seconds`, `rewards_per_second` in the step's measures).

A reward that is slow (a judge model, a reward served elsewhere) then costs the time it takes beyond the sampling, not
beside it; the scores, and so the step, are the same either way.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from qie.types import Batch

if TYPE_CHECKING:
    from qie.evaluation.reward import Reward
    from qie.training.objectives.context import ObjectiveContext


def rollout_shape(context: ObjectiveContext, batch: Batch, pixels: int | None) -> tuple[int, ...]:
    """The latent shape (C, F, h, w) rollouts of `batch` are sampled at: the batch's, or with `pixels` an area of
    about that many pixels at the batch's aspect ratio (each side a multiple of the family's patch)."""
    c, f, h, w = (int(x) for x in batch.latents.shape[1:])
    if pixels is None:
        return c, f, h, w
    scale, patch = context.pixels_per_latent(), context.family.patch_size
    factor = math.sqrt(pixels / (h * w * scale * scale))
    return c, f, max(patch, round(h * factor / patch) * patch), max(patch, round(w * factor / patch) * patch)


class Scoring:
    """Scores groups of edits with `reward` through the context (decoded here, scored in a background thread while
    the caller samples the next group, or at once without `overlap`), and times both sides: `sampled(seconds)` adds
    the caller's sampling time, `measures()` gives the step's."""

    def __init__(self, context: ObjectiveContext, reward: Reward, overlap: bool = True) -> None:
        self.context, self.reward, self.overlap = context, reward, overlap
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward") if overlap else None
        self.sampling = self.decoding = self.scoring = 0.0
        self.scored = 0

    def __enter__(self) -> Scoring:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def sampled(self, seconds: float) -> None:
        self.sampling += seconds

    def submit(self, batch: Batch, latents: torch.Tensor) -> Future:
        """The rewards (higher is better) of `latents`, the edits of `batch`'s samples (sample-major), to come."""
        started = time.perf_counter()
        images = self.context.decode(latents)
        self.decoding += time.perf_counter() - started
        copies = latents.shape[0] // len(batch.ids)
        if self.pool is None:
            done: Future = Future()
            done.set_result(self._score(images, batch, copies))
            return done
        return self.pool.submit(self._score, images, batch, copies)

    def _score(self, images: torch.Tensor, batch: Batch, copies: int) -> torch.Tensor:
        started = time.perf_counter()
        with torch.no_grad():
            scores = self.context.score(self.reward, images, batch, copies)
        self.scoring += time.perf_counter() - started
        self.scored += len(scores)
        return scores

    def measures(self) -> dict[str, Any]:
        """Seconds spent sampling (with decoding) and scoring, and edits scored per second of scoring."""
        return {
            "rollout_seconds": self.sampling + self.decoding,
            "reward_seconds": self.scoring,
            "rewards_per_second": self.scored / max(self.scoring, 1e-9),
        }


__all__ = ["Scoring", "rollout_shape"]
