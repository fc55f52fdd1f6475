"""What the training loop does when a step goes wrong: a NaN or infinite loss (or gradient), or a batch that
cannot be read mid-run. Either way the last good state is saved before the run stops."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from qie.errors import QieError


class NonFiniteLoss(QieError):
    """A training step gave a NaN or infinite loss or gradient (`train.on_nonfinite=stop`)."""


def window_is_finite(accelerator: Any, losses: Sequence[torch.Tensor], grad_norm: Any) -> bool:
    """Whether every process's losses of this optimizer step, and the gradient norm, are finite.

    One collective, so all processes decide alike (and skip or stop together)."""
    ok = all(bool(torch.isfinite(loss.detach()).all()) for loss in losses)
    ok = ok and (grad_norm is None or math.isfinite(float(grad_norm)))
    flag = torch.tensor([0.0 if ok else 1.0], device=accelerator.device)
    return accelerator.reduce(flag, "sum").item() == 0


def all_ids(accelerator: Any, ids: list[str]) -> list[str]:
    """The sample ids of every process's batches of this step."""
    if accelerator.num_processes == 1:
        return list(ids)
    from accelerate.utils import gather_object

    return [i for part in gather_object([ids]) for i in part]


def nonfinite_message(step: int, ids: list[str], saved: Path | None) -> str:
    where = f"; the last good state is saved in {saved}" if saved else ""
    return (
        f"step {step} gave a NaN or infinite loss or gradient on samples {', '.join(map(repr, ids))}{where}. "
        "Check those samples' cache entries (python -m qie.cache action=verify) and the learning rate; "
        "train.on_nonfinite=skip skips such steps instead."
    )


def save_before_stopping(
    save_checkpoint: Callable[[int, int], Path] | None, accelerator: Any, step: int, consumed, saved_at
) -> Path | None:
    """Save the state after `step` (unless saved already) when every process can take part: a step that
    failed on one process only (a batch it could not read) leaves the others inside the step's collectives,
    so with several processes the last periodic checkpoint stands."""
    if save_checkpoint is None or consumed is None or saved_at == step or accelerator.num_processes > 1:
        return None
    return save_checkpoint(step, consumed)
