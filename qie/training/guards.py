"""What the training loop does when a step goes wrong: a NaN or infinite loss (or gradient), or a batch that
cannot be read mid-run. Either way the last good state is saved before the run stops."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qie.errors import QieError


class NonFiniteLoss(QieError):
    """A training step gave a NaN or infinite loss or gradient (`train.on_nonfinite=stop`)."""


def agree_on_step(accelerator: Any, window_loss: float, grad_norm: Any, stop: bool) -> tuple[bool, float, bool]:
    """What every process decides alike about this optimizer step, from one collective (none with one process):
    whether every process's window loss and the gradient norm are finite, the window loss averaged over
    processes, and whether any process was asked to stop.

    Args:
        window_loss: this process's loss over the step's batches (NaN or infinite when one of them was).
        stop: whether this process got a stop signal.
    """
    ok = math.isfinite(window_loss) and (grad_norm is None or math.isfinite(float(grad_norm)))
    local = torch.tensor([window_loss, float(stop), 0.0 if ok else 1.0])
    n = accelerator.num_processes
    totals = local if n == 1 else accelerator.reduce(local.to(accelerator.device), "sum").cpu()
    loss, stops, bad = totals.tolist()
    return bad == 0, loss / n, stops > 0


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
