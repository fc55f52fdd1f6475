"""What the training loop does when a step goes wrong: a NaN or infinite loss (or gradient), non-finite trained
weights or optimizer state after an update, or a batch that cannot be read mid-run. The last good state is
saved before the run stops, and no state is saved (or called good) unless its weights and optimizer state are
finite."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils import get_total_norm

from qie.errors import QieError


class NonFiniteLoss(QieError):
    """A training step gave a NaN or infinite loss or gradient (`train.on_nonfinite=stop`)."""


@dataclass(frozen=True)
class StepAgreement:
    """What every process decides alike about an optimizer step (`agree_on_step`)."""

    finite: bool  # every process's window loss and the gradient norm are finite
    loss: float  # the window loss averaged over processes
    stop: bool  # a process was asked to stop (a signal)
    out_of_time: bool  # a process is past the run's wall-clock budget (`train.max_minutes`)
    metrics: dict[str, float]  # the objective's measures averaged over processes


def agree_on_step(
    accelerator: Any,
    window_loss: float,
    grad_norm: Any,
    stop: bool,
    metrics: dict[str, float] | None = None,
    out_of_time: bool = False,
) -> StepAgreement:
    """What every process decides alike about this optimizer step, from one collective (none with one process).

    Args:
        window_loss: this process's loss over the step's batches (NaN or infinite when one of them was).
        stop: whether this process got a stop signal.
        metrics: the objective's measures of this process's window (the same names on every process).
        out_of_time: whether this process is past the run's wall-clock budget.
    """
    metrics = metrics or {}
    ok = math.isfinite(window_loss) and (grad_norm is None or math.isfinite(float(grad_norm)))
    local = torch.tensor([window_loss, float(stop), 0.0 if ok else 1.0, float(out_of_time), *metrics.values()])
    n = accelerator.num_processes
    totals = local if n == 1 else accelerator.reduce(local.to(accelerator.device), "sum").cpu()
    loss, stops, bad, late, *sums = totals.tolist()
    return StepAgreement(bad == 0, loss / n, stops > 0, late > 0, {name: s / n for name, s in zip(metrics, sums)})


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # an FSDP shard: this process's part only


def state_is_finite(accelerator: Any, params: Sequence[torch.Tensor], optimizer: Any) -> bool:
    """Whether every process's trained weights and optimizer state tensors are finite (one collective).

    A NaN in the optimizer state (a poisoned checkpoint, an overflow in its moments) reaches the weights
    through an update whose loss is still finite, so the loss and gradient checks alone miss it.
    """
    flag = torch.tensor([0.0 if local_state_finite(params, optimizer) else 1.0], device=accelerator.device)
    return accelerator.reduce(flag, "sum").item() == 0


def local_state_finite(params: Sequence[torch.Tensor], optimizer: Any) -> bool:
    """Whether this process's trained weights (its shards) and optimizer state tensors are all finite."""
    tensors = [p.detach() for p in params]
    for entry in getattr(optimizer, "state", {}).values():
        tensors += [v for v in entry.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    tensors = [t for t in map(_local, tensors) if t.numel()]  # an empty tensor (or shard) is finite
    if not tensors:
        return True
    # The largest magnitude over every tensor (grouped by device and dtype, a few fused kernels, one wait for
    # the device): NaN when any element is NaN, infinite when any is infinite, else finite.
    return bool(torch.isfinite(get_total_norm(tensors, math.inf)))


def nonfinite_state_message(step: int, saved: Path | None) -> str:
    where = f"the last good state is saved in {saved}" if saved else "no earlier state of this run was saved"
    return (
        f"step {step} left NaN or infinite values in the trained weights or the optimizer state (a finite loss "
        f"can still give a NaN update, e.g. from a damaged optimizer state); nothing was saved after it: {where}. "
        "Lower the learning rate or resume from an earlier checkpoint."
    )


def all_ids(accelerator: Any, ids: list[str]) -> list[str]:
    """The sample ids of every process's batches of this step."""
    if accelerator.num_processes == 1:
        return list(ids)
    from accelerate.utils import gather_object

    return [i for part in gather_object([ids]) for i in part]


def nonfinite_weights(module: torch.nn.Module, frozen_only: bool = True) -> list[str]:
    """Names of the module's parameters (the frozen ones by default: the base model's) and buffers holding a NaN
    or an infinity."""
    params = [(n, p) for n, p in module.named_parameters() if not (frozen_only and p.requires_grad)]
    return [n for n, t in params + list(module.named_buffers()) if not _finite(t)]


def _finite(t: torch.Tensor) -> bool:
    if not t.is_floating_point() or not t.numel():
        return True
    try:
        return bool(torch.isfinite(t).all())
    except (RuntimeError, NotImplementedError, TypeError):  # a quantized tensor type without isfinite
        return bool(torch.isfinite(t.dequantize()).all()) if hasattr(t, "dequantize") else True


def damaged_weights(part: str, names: Sequence[str]) -> str:
    """The sentence naming a model part's non-finite weights and what to do."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"the {part}'s weights hold NaN or infinite values ({shown}): its weight files are damaged; load it "
        "from intact files (model.pretrained_model_name_or_path, model.transformer_path)"
    )


@dataclass(frozen=True)
class NonfiniteCause:
    """Where a step's NaN or infinite number came from, as the loop saw it: `inputs_finite` False when a batch of a
    non-finite loss held non-finite inputs (its cache entries), True when its inputs were finite (what computed the
    loss from them: the objective, a reward it calls), None when every loss was finite and the gradient was not;
    `objective` the objective's class."""

    inputs_finite: bool | None
    objective: type


def nonfinite_message(
    step: int,
    ids: list[str],
    saved: Path | None,
    model: torch.nn.Module | None = None,
    cause: NonfiniteCause | None = None,
) -> str:
    where = f"; the last good state is saved in {saved}" if saved else ""
    said = f"step {step} gave a NaN or infinite loss or gradient on samples {', '.join(map(repr, ids))}{where}"
    if model is not None and (bad := nonfinite_weights(model)):
        return f"{said}: {damaged_weights('base model', bad)}"
    skip = "train.on_nonfinite=skip skips such steps instead."
    if cause is not None and cause.inputs_finite is not False:
        name = f"train.objective ({cause.objective.__module__}.{cause.objective.__qualname__})"
        if cause.inputs_finite:
            return (
                f"{said}. The batch's inputs (their cache entries) were finite: the loss {name} computed from them "
                f"was not; check that objective (and any reward it calls) and the learning rate; {skip}"
            )
        return f"{said}. The loss was finite, its gradient not: check {name} and the learning rate; {skip}"
    return (
        f"{said}. Check those samples' cache entries (python -m qie.cache action=verify) and the learning rate; {skip}"
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
