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

A NaN score is the reward's fault unless it declares `nan_when_unmeasured` (a class attribute, False by default):
then a NaN says there was nothing to measure in that edit (an empty edit region), and means leave it out.

`score` is how the stages call a reward (eval, validation; online RL objectives): in a thread of its own, so that a
stop signal never waits for it and a timeout bounds it, its output checked (one finite number per edit); whatever
goes wrong ends in one line naming the reward's setting and class (`PluginError`).

This module imports torch and qie's leaf modules only: RL objectives and plug-ins import it without the stages.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from qie import stop_request
from qie.errors import PluginError, raised_at

# What a reward may ask for besides the images, controls and prompts (the keyword each is passed as).
NEEDS = {"target": "targets", "mask": "masks"}


@runtime_checkable
class Reward(Protocol):
    """Scores a batch of edits: `__call__(images, controls, prompts, **needed) -> tensor[B]` (see the module)."""

    needs: ClassVar[frozenset[str]] = frozenset()
    higher_is_better: ClassVar[bool] = True
    nan_when_unmeasured: ClassVar[bool] = False

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


@dataclass(frozen=True, kw_only=True)
class RewardCall:
    """One call of a reward: the edits and what they were made from (see the module), and the setting that names
    the reward (`eval.rewards.pixel_error`), for messages."""

    setting: str
    images: torch.Tensor
    controls: list[list[torch.Tensor]]
    prompts: list[str]
    targets: torch.Tensor | None = None
    masks: torch.Tensor | None = None


class RewardStopped(PluginError):
    """A stop was asked for while a reward scored: its scores are not waited for."""


def score(reward: Reward, call: RewardCall, timeout: float | None = None, unmeasured: bool = True) -> torch.Tensor:
    """The reward's scores of `call.images`, float64 (B,): the reward called with what it `needs`, in a thread of
    its own (the caller's grad and inference modes), and its output checked.

    Args:
        timeout: seconds the reward may take (None: no limit).
        unmeasured: whether a NaN may stand for "nothing to measure" (eval and validation leave it out of their
            means); only for a reward that declares `nan_when_unmeasured`. Training objectives pass False.

    Raises:
        PluginError: one line naming `call.setting` and the reward's class: it raised, returned no number per edit
            (None, a string, another count), an infinite score or a NaN it may not give, or took longer than
            `timeout`. RewardStopped: a stop was asked for (`qie.stop_request`) while it ran.
    """
    name = f"{call.setting} ({named(reward)})"
    needed = needed_arguments(reward, call.targets, call.masks)
    value = _in_thread(lambda: reward(call.images, call.controls, call.prompts, **needed), name, timeout)
    return checked(value, name, call.prompts, unmeasured and reward.nan_when_unmeasured)


def named(reward: Reward) -> str:
    """The reward's class as a `_target_` names it."""
    return f"{type(reward).__module__}.{type(reward).__qualname__}"


def checked(value: Any, name: str, prompts: list[str], nan_ok: bool = False) -> torch.Tensor:
    """What a reward (`name`, for messages) returned for the edits of `prompts`, as float64 (B,) scores.

    Raises:
        PluginError: no number per edit (None, a string, another count), an infinite score, or a NaN unless
            `nan_ok`.
    """
    edits = len(prompts)
    if value is None or isinstance(value, (str, bytes)):
        raise PluginError(f"{name} returned {_shown(value)}, not one score per edit: return a tensor of {edits}")
    try:
        scores = torch.as_tensor(value, dtype=torch.float64).detach().cpu().reshape(-1)
    except (TypeError, ValueError, RuntimeError) as e:
        raise PluginError(f"{name} returned {_shown(value)}, not numbers ({e}): return a tensor of {edits}") from None
    if scores.numel() != edits:
        raise PluginError(f"{name} returned {scores.numel()} score(s) for {edits} edit(s): return one per edit")
    bad = scores.isinf() | (scores.isnan() & (not nan_ok))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        hint = " (or declare nan_when_unmeasured where NaN means nothing to measure)" if scores[i].isnan() else ""
        raise PluginError(
            f"{name} returned {float(scores[i])} for edit {i} of {edits} (prompt {prompts[i]!r}): a reward's scores "
            f"must be finite numbers; fix the reward{hint}"
        )
    return scores


def _in_thread(fn: Any, name: str, timeout: float | None) -> Any:
    """`fn()` run in a thread of its own with the caller's grad and inference modes; the caller waits for it until
    it ends, `timeout` passes or a stop is asked for (the thread is then left to end by itself)."""
    grad, inference, box, done = torch.is_grad_enabled(), torch.is_inference_mode_enabled(), {}, threading.Event()

    def work() -> None:
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                box["value"] = fn()
        except BaseException as e:  # handed to the caller, named there
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=work, name="qie-reward", daemon=True).start()
    deadline = None if timeout is None else time.monotonic() + timeout
    while not done.wait(0.05):
        if stop_request.requested():
            raise RewardStopped(f"stopped while {name} was scoring: its scores are not waited for")
        if deadline is not None and time.monotonic() > deadline:
            raise PluginError(f"{name} took more than {timeout:g} s: make it quicker, or raise the reward timeout")
    if "error" in box:
        e = box["error"]
        raise PluginError(f"{name} raised {e.__class__.__name__}: {e}{raised_at(e)}") from e
    return box["value"]


def _shown(value: Any) -> str:
    """How a wrong return value is named in a message."""
    if value is None or isinstance(value, (str, bytes)):
        text = repr(value)
        return f"{type(value).__name__} {text[:60]}" if value is not None else "None"
    return f"a {type(value).__name__}"


def control_at(controls: list[torch.Tensor], size: tuple[int, int]) -> torch.Tensor | None:
    """A sample's first control image (3, H, W) resized to `size` (H, W) (bilinear, antialiased), or None."""
    if not controls:
        return None
    control = controls[0]
    if tuple(control.shape[-2:]) == tuple(size):
        return control
    resized = torch.nn.functional.interpolate(control[None].float(), size=size, mode="bilinear", antialias=True)
    return resized[0].clamp(0, 1).to(control.dtype)


__all__ = [
    "NEEDS",
    "Reward",
    "RewardCall",
    "RewardStopped",
    "control_at",
    "direction",
    "needed_arguments",
    "reward_value",
    "checked",
    "named",
    "score",
]
