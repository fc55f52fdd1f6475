"""Several rewards as one (`qie.evaluation.weighted.Weighted`): the weighted sum of their values, each score turned
"higher is better" first (`reward_value`: an error counts negatively), so rewards of both directions combine.

    reward:
      _target_: qie.evaluation.weighted.Weighted
      rewards:
        colour: {_target_: qie.demo.reward.RecolourReward}
        judge: {_target_: qie.evaluation.judge.VlmJudge}
      weights: {colour: 1.0, judge: 0.5}

Each part is built as a reward node is (`qie.evaluation.build.build_rewards`, its keys checked when the config is
composed); the run's model is handed to those that name it (a judge). A part that needs the target or the edit
region makes the whole need it (`needs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from qie.evaluation.reward import Reward, checked, named, needed_arguments, reward_value


class Weighted(Reward):
    """The weighted sum of the parts' values (see the module's text); higher is better.

    Args:
        rewards: name -> reward node (`_target_` and its keys).
        weights: name -> weight (1 for a part not named); every name must be a part's.
        model: the run's model config, handed to the parts that name it (`STAGE_KEYS`).
    """

    combines: ClassVar[str] = "rewards"  # the key of its parts' nodes, checked like any reward node's

    def __init__(self, rewards: Mapping[str, Any], weights: Mapping[str, float] | None = None, model: Any = None):
        from qie.evaluation.build import build_rewards

        if not rewards:
            raise ValueError("rewards is empty: give at least one part ({name: {_target_: pkg.Cls}})")
        weights = dict(weights or {})
        if unknown := sorted(set(weights) - set(rewards)):
            raise ValueError(f"weights names {unknown}, which are not among the rewards ({', '.join(rewards)})")
        stage = {} if model is None else {"model": model}
        self.parts = build_rewards(rewards, "rewards", **stage)
        self.weights = {name: float(weights.get(name, 1.0)) for name in self.parts}
        self.needs = frozenset().union(*(part.needs for part in self.parts.values()))
        self.nan_when_unmeasured = any(part.nan_when_unmeasured for part in self.parts.values())

    def __call__(
        self, images: torch.Tensor, controls: list[list[torch.Tensor]], prompts: list[str], **needed: Any
    ) -> torch.Tensor:
        total = torch.zeros(images.shape[0], dtype=torch.float64)
        targets, masks = needed.get("targets"), needed.get("masks")
        for name, part in self.parts.items():
            scores = part(images, controls, prompts, **needed_arguments(part, targets, masks))
            scores = checked(scores, f"rewards.{name} ({named(part)})", prompts, part.nan_when_unmeasured)
            value = reward_value(part, scores)
            total = total + self.weights[name] * value
        return total

    def describe(self) -> dict[str, Any]:
        return {name: {"weight": self.weights[name], **part.describe()} for name, part in self.parts.items()}


__all__ = ["Weighted"]
