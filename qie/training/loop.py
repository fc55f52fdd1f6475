"""The training loop: steps, gradient accumulation, logging and stop signals; it asks the objective for each
batch's loss, the checkpoint schedule when to save and the non-finite policy what a NaN step does
(`qie.training.policies`).

It is handed built objects (an Accelerator, a prepared model, optimizer, scheduler and a stream of
batches) and knows nothing of configs, caches or encoders.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qie.errors import Interrupted, QieError
from qie.progress import progress
from qie.runtime.guards import agree_on_step
from qie.training.logging import MetricsLogger
from qie.training.objectives import Objective
from qie.training.policies import CheckpointSchedule, NonfinitePolicy
from qie.types import Batch


@dataclass
class LoopSettings:
    max_steps: int
    seed: int
    # What each batch's loss is (`qie.training.objectives`): the loop only hands it the batch's generator.
    objective: Objective
    max_grad_norm: float = 1.0
    checkpoint_every: int = 0
    log_every: int = 1
    # A NaN/inf loss or gradient: "stop" (save the last good state) or "skip". Non-finite weights or optimizer
    # state after an update (checked on logged steps and before every save) always stop: the update is applied.
    on_nonfinite: str = "stop"
    # The wall-clock budget (`train.max_minutes`): `time.monotonic()` past which training stops at the next step
    # boundary and saves, as at the end; None: none.
    deadline: float | None = None


@dataclass
class TrainState:
    """What the loop trains: the prepared model, its trained parameters, optimizer and LR schedule.

    Args:
        accelerator: the run's Accelerator (device, processes, gradient accumulation, mixed precision).
        dtype: the dtype batches are cast to (the frozen base model's).
        start_step: the optimizer step training resumes after (0 for a new run).
    """

    accelerator: Any
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: Any
    lr_scheduler: Any
    dtype: torch.dtype
    start_step: int = 0


@dataclass
class StepInfo:
    """What a hook sees after each optimizer step."""

    step: int
    batch: Batch  # the last batch of the step
    loss: float  # mean over processes
    seconds: float  # wall time of the step, data wait included
    data_seconds: float = 0.0  # time this process waited for the step's batches
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's measures, alike on every process


def batch_generator(seed: int, batch_number: int, rank: int) -> torch.Generator:
    """Noise and sigmas of a batch depend on (seed, batch number, rank) only, so a resumed run repeats them.

    Drawn on the CPU so that every device gives the same numbers.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + batch_number) * 131 + rank)
    return g


class StopSignal:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each step (then it saves and exits)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:  # a second signal: the user does not want to wait for the step or the save
            raise Interrupted("a second signal stopped training without its stop save", signum)
        self.received = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def fit(
    state: TrainState,
    batches: Iterable[tuple[int, Batch]],
    settings: LoopSettings,
    logger: MetricsLogger,
    save_checkpoint: Callable[[int, int], Path] | None = None,
    on_step_end: Callable[[StepInfo], None] | None = None,
    last_saved: Path | None = None,
) -> dict:
    """Train until `settings.max_steps` optimizer steps (or a stop signal), from `state.start_step`.

    Args:
        batches: (batch number, Batch) pairs on the CPU; the stream must resume at `start_step`'s batch.
        save_checkpoint: called as save_checkpoint(step, batches_consumed) every `checkpoint_every` steps,
            at the end and on a stop signal, on every process.
        on_step_end: hook after each optimizer step, on every process (image logging, validation, timing).
        last_saved: the checkpoint this run resumed from (the last good state until this run saves one).

    Returns:
        {"step", "loss" (last), "losses" (per step of this run), "stopped_by_signal", "signal",
        "stopped_by_time" (the budget `settings.deadline` was spent), "skipped_nonfinite"}.

    Raises:
        NonFiniteLoss: a NaN or infinite loss or gradient with `on_nonfinite="stop"` (after saving the last
            good state), or non-finite weights or optimizer state after an update (nothing saved after it);
            a QieError of the batch stream (after saving, in a single-process run).
    """
    accelerator = state.accelerator
    checkpoints = CheckpointSchedule(save_checkpoint, settings.checkpoint_every, state, last_saved)
    nonfinite = NonfinitePolicy(settings.on_nonfinite, state)
    step, consumed = state.start_step, None
    losses: list[float] = []
    stream = iter(batches)
    stopping = late = False
    state.model.train()  # once: a step sets it again only when a hook left the model in eval mode
    bar = progress(settings.max_steps, "train", initial=step, disable=not accelerator.is_main_process)
    with StopSignal() as stop, bar:
        while step < settings.max_steps and not stopping:
            t0 = time.perf_counter()
            try:
                mean_loss, grad_norm, batch, window = _optimizer_step(state, stream, settings, stop)
            except Exception as e:
                if stop.received is None:
                    if isinstance(e, QieError) and checkpoints.before_stopping(step, consumed):
                        print(f"qie: saved the state after step {step} before stopping")
                    raise
                # A scheduler signals every process, loader workers included: a step that lost its data
                # is dropped and the last finished one is saved.
                print(f"qie: stopping; step {step + 1} not finished: {e}")
                stopping = True
                break
            if not window["finite"]:
                nonfinite.skip_or_stop(step, window["ids"], checkpoints, consumed)
                consumed = window["consumed"]
                continue
            consumed = window["consumed"]
            step += 1
            # Every process stops after the same step (decided with the step's one collective), or the
            # checkpoint's collectives would pair with another process's training step.
            stopping, late = window["stop"], window["late"] and not window["stop"]
            nonfinite.audit(step, settings.max_steps, checkpoints.last_good)
            losses.append(mean_loss)
            bar.set_postfix(**progress_measures(mean_loss, window["metrics"]))
            bar.update(1)
            seconds = time.perf_counter() - t0
            if step % settings.log_every == 0 or step == settings.max_steps:
                lr = state.lr_scheduler.get_last_lr()[0]
                norm = float(grad_norm) if grad_norm is not None else math.nan
                logger.log(
                    step, {"loss": mean_loss, "lr": lr, "grad_norm": norm, "seconds": seconds, **window["metrics"]}
                )
            if on_step_end is not None:
                try:
                    on_step_end(StepInfo(step, batch, mean_loss, seconds, window["waited"], window["metrics"]))
                except QieError:  # a hook's verdict (every process's alike): the state after this step is kept
                    if checkpoints.before_stopping(step, consumed):
                        print(f"qie: saved the state after step {step} before stopping")
                    raise
            checkpoints.after_step(step, consumed)
            if late:
                break
        checkpoints.at_end(step, consumed)
    signalled = stopping and not late
    return _result(step, losses, nonfinite.skipped, stop.received if signalled else None, signalled, late)


def progress_measures(loss: float, metrics: dict[str, float]) -> dict[str, str]:
    """What the progress line shows of a step: its loss (4 significant digits: an online-RL loss is near 0) and, for
    an objective that scores its own results, their mean reward."""
    shown = {"loss": f"{loss:.4g}"}
    if "reward_mean" in metrics:
        shown["reward"] = f"{metrics['reward_mean']:.4f}"
    return shown


def _result(step: int, losses: list[float], skipped: list, received: int | None, stopping: bool, late: bool) -> dict:
    """What `fit` returns; a stop another process's signal decided is reported as SIGTERM (a scheduler's)."""
    signum = int(received or signal.SIGTERM) if stopping else None
    last = losses[-1] if losses else math.nan
    return {
        "step": step,
        "loss": last,
        "losses": losses,
        "stopped_by_signal": stopping,
        "signal": signum,
        "stopped_by_time": late,
        "skipped_nonfinite": skipped,
    }


def _optimizer_step(
    state: TrainState, stream: Iterator[tuple[int, Batch]], settings: LoopSettings, stop: StopSignal
) -> tuple[float, torch.Tensor | None, Batch, dict]:
    """One optimizer step over `gradient_accumulation_steps` batches; none when a loss or the gradient is not
    finite on any process (the gradients are dropped).

    Returns:
        (loss of the window averaged over processes, grad norm before clipping, last batch,
        {"consumed": batches consumed, "finite": whether the step was taken, "ids": the window's samples,
        "waited": seconds spent waiting for the batches, "stop": whether a process was asked to stop,
        "metrics": the objective's measures of the window, averaged over processes}).
    """
    accelerator, model = state.accelerator, state.model
    if not model.training:  # train() walks every module: not on every step
        model.train()
    window_loss, grad_norm, waited, finite, ids, mean_loss, stopping = 0.0, None, 0.0, True, [], math.nan, False
    late = False
    metrics: dict[str, float] = {}
    micro_steps = accelerator.gradient_accumulation_steps
    for _ in range(micro_steps):
        t0 = time.perf_counter()
        number, batch = next(stream)
        waited += time.perf_counter() - t0
        with accelerator.accumulate(model):
            batch = batch.to(accelerator.device, state.dtype)
            g = batch_generator(settings.seed, number, accelerator.process_index)
            loss = settings.objective.loss(model, batch, g)
            accelerator.backward(loss)
            ids += batch.ids
            window_loss += loss.detach().float().item() / micro_steps
            if accelerator.sync_gradients:
                # An infinite bound measures the norm without clipping, so grad_norm is always logged.
                max_norm = settings.max_grad_norm if settings.max_grad_norm > 0 else math.inf
                grad_norm = accelerator.clip_grad_norm_(state.params, max_norm)
                out_of_time = settings.deadline is not None and time.monotonic() >= settings.deadline
                agreed = agree_on_step(
                    accelerator,
                    window_loss,
                    grad_norm,
                    stop.received is not None,
                    settings.objective.step_metrics(),
                    out_of_time,
                )
                finite, mean_loss, stopping, late, metrics = (
                    agreed.finite,
                    agreed.loss,
                    agreed.stop,
                    agreed.out_of_time,
                    agreed.metrics,
                )
            # accelerate's wrapped optimizer skips step and zero_grad until the window's last batch
            if finite:
                state.optimizer.step()
                if accelerator.sync_gradients:
                    state.lr_scheduler.step()
            state.optimizer.zero_grad(set_to_none=True)
    window = {
        "consumed": number + 1,
        "finite": finite,
        "ids": ids,
        "waited": waited,
        "stop": stopping,
        "late": late,
        "metrics": metrics,
    }
    return mean_loss, grad_norm, batch, window
