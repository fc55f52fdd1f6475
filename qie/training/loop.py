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

from qie import stop_request
from qie.errors import Interrupted, PluginError, QieError, raised_at
from qie.progress import progress
from qie.runtime.guards import NonfiniteCause, agree_on_step
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
    """Turns SIGINT/SIGTERM into a flag the loop checks after each step (then it saves and exits), and says so to
    code waiting on a plug-in (`qie.stop_request`: a reward is not waited for). A step hook that failed asks for the
    same stop (`failed`): every process stops after the same step."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.failed: BaseException | None = None
        self._previous: dict[int, object] = {}

    @property
    def asked(self) -> bool:
        """Whether this process asks to stop: a signal, or a failed step hook."""
        return self.received is not None or self.failed is not None

    def __enter__(self) -> StopSignal:
        stop_request.clear()
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
        stop_request.request()

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        stop_request.clear()


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
        "stopped_by_time" (the budget `settings.deadline` was spent), "skipped_nonfinite",
        "failure": the exception a step hook raised (training stopped after that step, its state saved) or None}.

    Raises:
        NonFiniteLoss: a NaN or infinite loss or gradient with `on_nonfinite="stop"` (after saving the last
            good state), or non-finite weights or optimizer state after an update (nothing saved after it);
            PluginError: the objective's loss raised or returned no scalar tensor with a gradient; these and a
            QieError of the batch stream after saving the last finished step, in a single-process run.
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
                _step_failed(e, stop, checkpoints, step, consumed)  # raises unless a stop signal cut the step short
                stopping = True
                break
            if not window["finite"]:
                cause = NonfiniteCause(window["inputs_finite"], type(settings.objective))
                nonfinite.skip_or_stop(step, window["ids"], checkpoints, consumed, cause)
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
                info = StepInfo(step, batch, mean_loss, seconds, window["waited"], window["metrics"])
                stopping = _after_step(on_step_end, info, stop, accelerator.num_processes) or stopping
            checkpoints.after_step(step, consumed)
            if late:
                break
        checkpoints.at_end(step, consumed)
    return _result(step, losses, nonfinite.skipped, stop, stopping and not late) | {"stopped_by_time": late}


def _step_failed(e: Exception, stop: StopSignal, checkpoints: CheckpointSchedule, step: int, consumed: Any) -> None:
    """A step that raised `e`: re-raised (a QieError after saving the last finished step), unless a stop signal came
    first: a scheduler signals every process, loader workers included, so a step that lost its data is dropped and
    the last finished one is saved as at any stop."""
    if stop.received is None:
        if isinstance(e, QieError) and checkpoints.before_stopping(step, consumed):
            print(f"qie: saved the state after step {step} before stopping")
        raise e
    print(f"qie: stopping; step {step + 1} not finished: {e}")


def progress_measures(loss: float, metrics: dict[str, float]) -> dict[str, str]:
    """What the progress line shows of a step: its loss (4 significant digits: an online-RL loss is near 0) and, for
    an objective that scores its own results, their mean reward."""
    shown = {"loss": f"{loss:.4g}"}
    if "reward_mean" in metrics:
        shown["reward"] = f"{metrics['reward_mean']:.4f}"
    return shown


def _after_step(hook: Callable[[StepInfo], None], info: StepInfo, stop: StopSignal, processes: int) -> bool:
    """Run the step hooks; True when training stops after this step: a hook failed (validation's reward, a
    plug-in's hook), or a stop signal cut a hook short (a reward not waited for). The step itself is complete, so
    its state is saved as at any end. With several processes a failure is shared at the next step's collective."""
    try:
        hook(info)
    except Exception as e:
        if stop.received is not None:
            print(f"qie: stopping; the step hooks after step {info.step} were cut short: {e}", flush=True)
            return True
        if stop.failed is None:
            stop.failed = e
            print(f"qie: stopping after step {info.step}: {e}", flush=True)
        return processes == 1
    return False


def _result(step: int, losses: list[float], skipped: list, stop: StopSignal, stopping: bool) -> dict:
    """What `fit` returns; a stop another process's signal decided is reported as SIGTERM (a scheduler's)."""
    by_signal = stopping and stop.failed is None
    signum = int(stop.received or signal.SIGTERM) if by_signal else None
    last = losses[-1] if losses else math.nan
    return {
        "step": step,
        "loss": last,
        "losses": losses,
        "stopped_by_signal": by_signal,
        "signal": signum,
        "skipped_nonfinite": skipped,
        "failure": stop.failed,
    }


def objective_loss(
    objective: Objective, model: torch.nn.Module, batch: Batch, generator: torch.Generator
) -> torch.Tensor:
    """`objective.loss(model, batch, generator)`, checked: what the objective's own code raises, or a loss that is
    no one-number tensor with a gradient (a float, a detached tensor, several numbers), is a PluginError naming
    the objective by its class (its `_target_`); qie's errors and running out of memory pass as they are."""
    name = f"train.objective ({type(objective).__module__}.{type(objective).__qualname__})"
    try:
        loss = objective.loss(model, batch, generator)
    except (QieError, torch.OutOfMemoryError):
        raise
    except Exception as e:
        raise PluginError(
            f"{name} raised {e.__class__.__name__} in the loss of samples {', '.join(batch.ids)}: {e}{raised_at(e)}"
        ) from e
    if not isinstance(loss, torch.Tensor):
        what = f"a {type(loss).__name__}"
    elif loss.numel() != 1:
        what = f"a tensor of {loss.numel()} numbers"
    elif not loss.requires_grad:
        what = "a tensor without a gradient (detached, or computed under no_grad)"
    else:
        return loss
    raise PluginError(
        f"{name}'s loss returned {what}: return one number as a tensor computed from the model's output, so that "
        "its gradient trains the model"
    )


def inputs_finite(batch: Batch) -> bool:
    """Whether every floating tensor the batch holds (latents, embeddings, fields, its loss mask) is finite."""
    tensors = [batch.latents, batch.prompt_embeds, *batch.control_latents, *batch.fields.values()]
    tensors += [t for t in (batch.negative_prompt_embeds, batch.loss_mask) if t is not None]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def _optimizer_step(
    state: TrainState, stream: Iterator[tuple[int, Batch]], settings: LoopSettings, stop: StopSignal
) -> tuple[float, torch.Tensor | None, Batch, dict]:
    """One optimizer step over `gradient_accumulation_steps` batches; none when a loss or the gradient is not
    finite on any process (the gradients are dropped).

    Returns:
        (loss of the window averaged over processes, grad norm before clipping, last batch,
        {"consumed": batches consumed, "finite": whether the step was taken, "ids": the window's samples,
        "waited": seconds spent waiting for the batches, "stop": whether a process was asked to stop,
        "metrics": the objective's measures of the window, averaged over processes, "inputs_finite": whether this
        process's batches of a non-finite loss were finite (None: its losses were finite)}).
    """
    accelerator, model = state.accelerator, state.model
    if not model.training:  # train() walks every module: not on every step
        model.train()
    window_loss, grad_norm, waited, finite, ids, mean_loss, stopping = 0.0, None, 0.0, True, [], math.nan, False
    inputs_ok, late = True, False
    metrics: dict[str, float] = {}
    micro_steps = accelerator.gradient_accumulation_steps
    for _ in range(micro_steps):
        t0 = time.perf_counter()
        number, batch = next(stream)
        waited += time.perf_counter() - t0
        with accelerator.accumulate(model):
            batch = batch.to(accelerator.device, state.dtype)
            g = batch_generator(settings.seed, number, accelerator.process_index)
            loss = objective_loss(settings.objective, model, batch, g)
            accelerator.backward(loss)
            ids += batch.ids
            value = loss.detach().float().item()
            if not math.isfinite(value):  # whose fault: the cache's entries, or what computed the loss from them
                inputs_ok = inputs_ok and inputs_finite(batch)
            window_loss += value / micro_steps
            if accelerator.sync_gradients:
                # An infinite bound measures the norm without clipping, so grad_norm is always logged.
                max_norm = settings.max_grad_norm if settings.max_grad_norm > 0 else math.inf
                grad_norm = accelerator.clip_grad_norm_(state.params, max_norm)
                out_of_time = settings.deadline is not None and time.monotonic() >= settings.deadline
                agreed = agree_on_step(
                    accelerator, window_loss, grad_norm, stop.asked, settings.objective.step_metrics(), out_of_time
                )
                finite, mean_loss, stopping, late = agreed.finite, agreed.loss, agreed.stop, agreed.out_of_time
                metrics = agreed.metrics
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
        # None: every loss of the window was finite; False: a non-finite one came with non-finite inputs.
        "inputs_finite": None if math.isfinite(window_loss) else inputs_ok,
    }
    return mean_loss, grad_norm, batch, window
