"""The reward protocol: one score per image, shared by evaluation metrics, judges, sweep objectives and RL rewards.

A reward is called with a batch of edited images and what each was made from:

    reward(images, controls, prompts) -> tensor[B]

- `images`: float (B, 3, H, W) in [0, 1], the outputs;
- `controls`: per sample, its control images, each float (3, h, w) in [0, 1] at its own size (none for text to
  image);
- `prompts`: per sample, its instruction.

A reward that compares with what a sample should look like says so in `needs` (a class attribute): with
`"target"` it is also given `targets=` (float (B, 3, H, W) in [0, 1], at the images' size), with `"mask"`
`masks=` (bool (B, H, W): the edit region, the row's own mask, or where its control and target differ). Rows
without a target are refused only by the stages that would call such a reward.

Direction: `higher_is_better` (a class attribute, True by default). A metric reports its own unit under its own
name (`pixel_error` is a mean absolute error in [0, 1], lower is better); `reward_value` turns any score into the
"higher is better" value RL and searches maximise (the score, or its negative).

`describe()` returns what makes the scores comparable across runs (a judge's prompt and model fingerprint); the
eval stage writes it into eval.json. A reward from outside qie subclasses `qie.extend.Reward` (for these
defaults) and is configured as `eval.rewards.<name>._target_=pkg.Cls` with its own keys.

This module imports torch only: RL objectives and plug-ins import it without the stages.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

# What a reward may ask for besides the images, controls and prompts (the keyword each is passed as).
NEEDS = {"target": "targets", "mask": "masks"}


@runtime_checkable
class Reward(Protocol):
    """Scores a batch of edits: `__call__(images, controls, prompts, **needed) -> tensor[B]` (see the module)."""

    needs: ClassVar[frozenset[str]] = frozenset()
    higher_is_better: ClassVar[bool] = True

    def __call__(
        self, images: torch.Tensor, controls: list[list[torch.Tensor]], prompts: list[str], **needed: Any
    ) -> torch.Tensor:
        """One score per image, float (B,); `needed` holds `targets=`/`masks=` as `needs` asks."""
        ...

    def describe(self) -> dict[str, Any]:
        """What makes the scores comparable across runs (prompts, model fingerprints); {} when nothing does."""
        return {}


def reward_value(reward: Reward, scores: torch.Tensor) -> torch.Tensor:
    """`scores` as a reward: higher is better (the negative of an error)."""
    return scores if reward.higher_is_better else -scores


def direction(reward: Reward) -> str:
    """ "higher" or "lower": which way the reward's scores are better (eval.json's `directions`)."""
    return "higher" if reward.higher_is_better else "lower"


def needed_arguments(reward: Reward, targets: torch.Tensor | None, masks: torch.Tensor | None) -> dict[str, Any]:
    """The keywords `reward` is called with besides images, controls and prompts: those it `needs`."""
    given = {"targets": targets, "masks": masks}
    return {NEEDS[n]: given[NEEDS[n]] for n in sorted(reward.needs)}


def control_at(controls: list[torch.Tensor], size: tuple[int, int]) -> torch.Tensor | None:
    """A sample's first control image (3, H, W) resized to `size` (H, W) (bilinear, antialiased), or None."""
    if not controls:
        return None
    control = controls[0]
    if tuple(control.shape[-2:]) == tuple(size):
        return control
    resized = torch.nn.functional.interpolate(control[None].float(), size=size, mode="bilinear", antialias=True)
    return resized[0].clamp(0, 1).to(control.dtype)


__all__ = ["NEEDS", "Reward", "control_at", "direction", "needed_arguments", "reward_value"]
