"""Two small policies the training loop calls: when the state is saved (`CheckpointSchedule`) and what a step
with a NaN or infinite loss or gradient does (`NonfinitePolicy`), with the check of the weights after updates."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qie.runtime.guards import (
    NonfiniteCause,
    NonFiniteLoss,
    all_ids,
    nonfinite_message,
    nonfinite_state_message,
    save_before_stopping,
    state_is_finite,
)

# How often the trained weights and optimizer state are checked for NaN/inf between saves (a reduction over every
# trained tensor: a few percent of a tiny model's step when run on every step).
STATE_CHECK_EVERY = 50


class CheckpointSchedule:
    """Saves every `every` optimizer steps and at the end, and before stopping on an error where every process can
    take part; a state with NaN or infinite weights or optimizer state is never saved.

    Args:
        save: `save(step, batches_consumed) -> folder`, called on every process; None saves nothing.
        state: the loop's TrainState (accelerator, trained params, optimizer).
        last_saved: the checkpoint the run resumed from: the last good state until this run saves one.
    """

    def __init__(
        self, save: Callable[[int, int], Path] | None, every: int, state: Any, last_saved: Path | None = None
    ) -> None:
        self._save, self.every, self.state = save, every, state
        self.last_good, self.saved_at = last_saved, None

    def save(self, at: int, batches: int, strict: bool = True) -> Path | None:
        """Save the state after step `at` if its weights and optimizer state are finite (every process).
        Otherwise raise NonFiniteLoss (`strict`) or save nothing."""
        if self._save is None:
            return None
        s = self.state
        if not state_is_finite(s.accelerator, s.params, s.optimizer):
            if strict:
                raise NonFiniteLoss(nonfinite_state_message(at, self.last_good))
            return None
        self.last_good = self._save(at, batches)
        return self.last_good

    def after_step(self, step: int, consumed: int) -> None:
        """Save when `step` is due."""
        if self._save is not None and self.every and step % self.every == 0:
            self.save(step, consumed)
            self.saved_at = step

    def at_end(self, step: int, consumed: int | None) -> None:
        """Save the last step, unless nothing was trained or it was just saved."""
        if self._save is not None and consumed is not None and self.saved_at != step:
            self.save(step, consumed)

    def before_stopping(self, step: int, consumed: int | None) -> Path | None:
        """Save the state after `step` before the run stops on an error (see `guards.save_before_stopping`)."""
        good = functools.partial(self.save, strict=False)
        return save_before_stopping(good, self.state.accelerator, step, consumed, self.saved_at)


class NonfinitePolicy:
    """A NaN or infinite loss or gradient: "stop" (save the last good state, raise) or "skip" the step. Non-finite
    weights or optimizer state after an update (checked every STATE_CHECK_EVERY steps and at the last) always stop:
    the update is applied."""

    def __init__(self, on_nonfinite: str, state: Any) -> None:
        self.on_nonfinite, self.state = on_nonfinite, state
        self.skipped: list[list[str]] = []

    def skip_or_stop(
        self,
        step: int,
        ids: list[str],
        checkpoints: CheckpointSchedule,
        consumed: int | None,
        cause: NonfiniteCause | None = None,
    ) -> None:
        """Record a skipped step `step + 1` of samples `ids` (this process's), or save and raise NonFiniteLoss;
        `cause` says where the non-finite number came from (the inputs, or what computed the loss from them)."""
        accelerator = self.state.accelerator
        ids = all_ids(accelerator, ids)
        if self.on_nonfinite == "skip":
            accelerator.print(f"qie: warning: {nonfinite_message(step + 1, ids, None, cause=cause)} Skipped.")
            self.skipped.append(ids)
            return
        saved = checkpoints.before_stopping(step, consumed)
        last = saved or checkpoints.last_good
        raise NonFiniteLoss(nonfinite_message(step + 1, ids, last, self.state.model, cause))

    def audit(self, step: int, max_steps: int, last_good: Path | None) -> None:
        """Raise NonFiniteLoss when the update of `step` left NaN or infinite weights or optimizer state. Between
        checks such a state cannot pass unseen: the next step's loss is NaN (the loss guard stops there), and no
        checkpoint is written without the check."""
        if step % STATE_CHECK_EVERY and step != max_steps:
            return
        s = self.state
        if not state_is_finite(s.accelerator, s.params, s.optimizer):
            raise NonFiniteLoss(nonfinite_state_message(step, last_good))
