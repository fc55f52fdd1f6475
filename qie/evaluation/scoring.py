"""Scoring a run's edits with the rewards, and the means eval.json reports: over every row and seed (`metrics`),
per value of the rows' category (`categories`), and per row (`samples`).

A row is scored alone (a batch of one): rows of different sizes need no common size. A score that is nan (nothing
to measure, e.g. an empty edit region: only from a reward that declares `nan_when_unmeasured`, any other NaN is
refused by `reward.score`) is left out of every mean; a mean of no number is None (null in JSON).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from qie.data.images import rgb
from qie.evaluation.reward import Reward, RewardCall, score


@dataclass(frozen=True)
class Row:
    """What a row's edits are scored against: its id, prompt, category (None: none), control images (3, h, w) and,
    where known, its target (3, H, W) at the edit's size and edit region (H, W) bool, all in [0, 1]."""

    id: str
    prompt: str
    category: str | None
    controls: list[torch.Tensor]
    target: torch.Tensor | None = None
    region: torch.Tensor | None = None


def score_row(
    rewards: Mapping[str, Reward], image: torch.Tensor, row: Row, setting: str = "eval.rewards", timeout=None
) -> dict[str, float]:
    """Every reward's score of one edit (3, H, W) of `row`, by name, each called and checked by `reward.score`
    (`setting`: the node naming the rewards, for messages; `timeout`: seconds each may take, None: no limit).

    Raises:
        PluginError: a reward that raised, returned no number for the edit or a NaN it may not give, or took too long.
    """
    targets = None if row.target is None else row.target[None]
    masks = None if row.region is None else row.region[None]
    scores = {}
    for name, reward in rewards.items():
        if ("target" in reward.needs and targets is None) or ("mask" in reward.needs and masks is None):
            scores[name] = math.nan  # nothing to compare with: left out of the means
            continue
        controls = [rgb(c) for c in row.controls]
        call = RewardCall(
            setting=f"{setting}.{name}",
            images=rgb(image)[None],
            controls=[controls],
            prompts=[row.prompt],
            targets=targets,
            masks=masks,
        )
        scores[name] = float(score(reward, call, timeout)[0])
    return scores


def mean(values: Sequence[float]) -> float | None:
    """The mean of the numbers that are not nan; None when none is."""
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else None


def summarize(
    rows: Sequence[Row], scores: Sequence[Sequence[dict[str, float]]], seeds: Sequence[int], names: Sequence[str]
) -> dict:
    """A run's `metrics`, `categories` and `samples` from its scores: `scores[s][i]` is row i's at seeds[s]."""
    samples = {}
    for i, row in enumerate(rows):
        per_seed = {str(seed): scores[s][i] for s, seed in enumerate(seeds)}
        metrics = {n: mean([scores[s][i][n] for s in range(len(seeds))]) for n in names}
        samples[row.id] = {"prompt": row.prompt, "category": row.category, "metrics": metrics, "seeds": per_seed}
    flat = [(row, scores[s][i]) for s in range(len(seeds)) for i, row in enumerate(rows)]

    def means(pairs: list) -> dict[str, float | None]:
        return {n: mean([score[n] for _, score in pairs]) for n in names}

    categories = sorted({row.category for row in rows if row.category is not None})
    by_category = {}
    for c in categories:
        pairs = [p for p in flat if p[0].category == c]
        by_category[c] = {"rows": sum(r.category == c for r in rows), "metrics": means(pairs)}
    return {"metrics": means(flat), "categories": by_category, "samples": samples}


__all__ = ["Row", "mean", "score_row", "summarize"]
