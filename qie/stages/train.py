"""The train stage: build the transformer (+LoRA), the embedding source and the loop, then run it.

Cached mode builds only the transformer and scheduler: never the text encoder or the VAE (logged images are read
from the sample files); live and lazy modes build the encoders too. Loss masks are read and checked at start.

Run it with `python -m qie.train ...`; `accelerate launch` (or `torchrun`) runs it data-parallel. A Hydra
sweep (`python -m qie.train -m train.learning_rate=1e-4,3e-4`) gives each job its own run directory
(`multirun/<date>/<time>/<job number>`); to send the jobs to a Slurm cluster, install `qie[slurm]` and
add `hydra/launcher=submitit_slurm hydra.launcher.gpus_per_node=1 hydra.launcher.timeout_min=600`.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from qie import run_lock
from qie.cache.base import CacheBackend
from qie.checks import Checked, check
from qie.components import prepare_model
from qie.config.backend import build_backend
from qie.config.cache import CacheConfig
from qie.data import file_stats
from qie.data.fields import run_fields, with_defaults
from qie.errors import ConfigError, Interrupted, PluginError, QieError, check_writable
from qie.stages.accelerator import make_accelerator
from qie.stages.auto_caption import auto_captions
from qie.stages.background import in_background
from qie.stages.heldout import HeldOut, split_heldout
from qie.stages.objective_store import objective_store
from qie.stages.processes import elastic_problem
from qie.stages.recipe import Recipe
from qie.stages.run_outputs import RunOutputs
from qie.stages.sources import build_source
from qie.stages.train_data import load_samples, loader_settings, make_sampler, ready_data, sample_rows
from qie.stages.train_end import RESULT_FILE, Checkpoints, finish
from qie.stages.train_extras import lora_exports, make_ema, regularization_logging
from qie.stages.train_hooks import HookInputs, search_result, step_hooks
from qie.stages.train_model import (
    base_model_key,
    build_train_state,
    load_model,
    loop_settings,
    make_objective,
    objective_context,
    run_records,
)
from qie.stages.train_report import rebuilt_command, record_run
from qie.stages.train_setup import TrainSetup, train_setup
from qie.training import checkpoint as ckpt
from qie.training.batches import EmbeddingDataset, make_loader, raise_failures
from qie.training.ema import resume_ema
from qie.training.logging import MetricsLogger
from qie.training.loop import StepInfo, fit
from qie.training.objective_state import restore_kept
from qie.training.objectives import field_names, objective_class, trains_on_targets
from qie.training.run_record import check_resume
from qie.types import TRAINING_TYPES

TRACEBACK_FILE = "error_traceback.txt"  # where a failure of user code (an objective, a reward) keeps its traceback


def run(cfg: DictConfig, run_dir: Path, on_step_end: Callable[[StepInfo], None] | None = None) -> dict:
    """Train as `cfg` says (the stage from code: `cfg` checked once, `qie.checks.check`, then `start`), writing metrics,
    TensorBoard logs, checkpoints and the weights under `run_dir`.

    Args:
        on_step_end: an extra hook after each optimizer step (benchmarks time steps with it).

    Returns:
        The result also written to train_result.json: step, loss, losses, stopped_by_signal, lora, ...

    Raises:
        QieError subclasses for what a user can fix (config, data, cache misses, models), and StorageError when
        another process trains in `run_dir` (one writer per run folder, see `qie.run_lock`).
    """
    return start(check(cfg), run_dir, on_step_end)


def start(checked: Checked, run_dir: Path, on_step_end: Callable[[StepInfo], None] | None = None) -> dict:
    """The stage's edge: a checked config's typed groups read into a `TrainSetup` (what reads files checked before
    anything loads), run by the `TrainRecipe`. See `run`."""
    groups = checked.groups
    if not groups.data.path:
        raise ConfigError("data.path is not set: point it at a data set folder or manifest")
    spec = prepare_model(groups.model)  # first: a checkpoint of another model is named before anything else
    setup = train_setup(spec, groups, checked.precompute_command, checked.values)
    outputs, command = RunOutputs.of(checked.root.run), rebuilt_command(checked.values)
    setup = dataclasses.replace(setup, outputs=outputs, run_command=command)
    return TrainRecipe(setup, Path(run_dir), groups.cache, on_step_end).execute()


class TrainRecipe(Recipe):
    """The train stage: `setup()` builds the run (each `_setup_*` keeps what it builds on the object), `run()`
    trains and exports, `cleanup()` gives back what the run held; `execute` runs the three.

    Args:
        setup: the run's typed settings (`train_setup`).
        run_dir: where the run writes (hydra.run.dir).
        cache: the cache group (its backend is built from `cache.backend`: `build_backend`).
        on_step_end: an extra hook after each optimizer step.
    """

    def __init__(
        self,
        setup: TrainSetup,
        run_dir: Path,
        cache: CacheConfig,
        on_step_end: Callable[[StepInfo], None] | None = None,
    ) -> None:
        self.s, self.run_dir, self.cache, self.on_step_end = setup, run_dir, cache, on_step_end
        self.started = time.monotonic()  # train.max_minutes counts from here
        self.accelerator: Any = None
        self.locked = self.frozen = self.claimed = False
        self.logger: MetricsLogger | None = None

    def setup(self) -> None:
        """Everything the loop needs, in order: the accelerator, run lock and run record, the cache backend, the
        checkpoint resumed from, the embedding source, the data and model, the objective and training state, the
        batches, the logger and the step hooks."""
        s = self.s
        self._setup_accelerator()
        s.outputs.claim(s.train.resume, self.accelerator)  # the store checked (and taken) before anything loads
        self.claimed = True
        record_run(self.run_dir, s.run_command, s.run_config, self.accelerator)
        # A backend whose start-up check reads an index starts reading it now, beside the data set's scan.
        ahead = TRAINING_TYPES if str(s.source.mode) == "cached" else ()
        self.backend: CacheBackend = build_backend(self.cache, read_ahead=ahead)
        self._setup_resume()
        self.source = build_source(s.source, s.spec, self.backend)
        self._setup_data_and_model()
        self._setup_state()
        self._setup_loader()
        self._setup_hooks()

    def run(self) -> dict:
        """Train, measure the held-out samples, export the weights and publish the run's outputs. A step hook or
        the held-out measures failing (a validation reward of one's own) ends the run as a stop does, its weights
        exported and its state saved, then raises that error.

        Raises:
            PluginError: the objective's code failed (the last finished step saved first), or a step hook's or the
                held-out measures' did (after the export); its traceback is written to `TRACEBACK_FILE`.
        """
        s, state = self.s, self.state
        try:
            settings = loop_settings(s.train, s.logging, self.objective, self.started)
            result = fit(
                state,
                raise_failures(self.loader),
                settings,
                self.logger,
                save_checkpoint=self.save,
                on_step_end=lambda info: [hook(info) for hook in self.hooks],
                last_saved=self.resume_from,
            )
            failure = result.pop("failure")
            if failure is None:
                failure = self._measure(result)
        except Interrupted as e:  # a second stop signal: name what is kept, now that an unfinished save is removed
            raise Interrupted(ckpt.kept_after_interrupt(self.run_dir, self.resume_from), e.signum) from None
        except PluginError as e:  # the objective's own code: its state before the step is saved
            self._failed(e)
            raise
        finally:
            self._close_logger()
        self._unfreeze()
        if failure is not None:
            result["error"] = str(failure)
        finish(state, s.mode, self.run_dir, result, lora_exports(s.train), self.ema)
        s.outputs.publish(self.run_dir, self.accelerator)
        if failure is not None:
            self._failed(failure)
            raise failure
        return result

    def _measure(self, result: dict) -> QieError | None:
        """Add the held-out measures and the search metric to `result`; the QieError that stopped them, or None."""
        try:
            self.heldout.measure_into(result)
            result.update(search_result(self.s.validation, self.run_dir))
        except QieError as e:
            return e
        return None

    def _failed(self, e: BaseException) -> None:
        """Write the traceback of a failure of user code (`PluginError`: its cause's) into the run folder and say
        how to go on (the main process)."""
        if not self.accelerator.is_main_process:
            return
        if isinstance(e, PluginError):
            text = "".join(traceback.format_exception(e))
            (self.run_dir / TRACEBACK_FILE).write_text(text, encoding="utf-8")
            print(f"qie: the traceback of the error: {self.run_dir / TRACEBACK_FILE}", flush=True)
        if ckpt.complete_checkpoints(self.run_dir):
            print(f"qie: once it is fixed, continue with train.resume=latest hydra.run.dir={self.run_dir}", flush=True)

    def cleanup(self) -> None:
        """Close the logger, let the collector see the run's objects again and release the run folder's lock."""
        self._close_logger()
        self._unfreeze()
        if self.claimed:
            self.s.outputs.release()
            self.claimed = False
        if self.locked:
            run_lock.release(self.run_dir)
            self.locked = False

    def _setup_accelerator(self) -> None:
        s = self.s
        if problem := elastic_problem():  # before the process group: a restart would hang in its rendezvous
            raise ConfigError(problem)
        self.accelerator = make_accelerator(s.train, s.memory, str(s.model.dtype), self.run_dir)
        if self.accelerator.is_main_process:
            check_writable(self.run_dir, "the run directory (hydra.run.dir)")
            run_lock.acquire(self.run_dir)
            self.locked = True

    def _setup_resume(self) -> None:
        self.resume_from = self.s.outputs.resume_from(self.s.train.resume, self.run_dir, self.accelerator)
        self.resumed = ckpt.read_state(self.resume_from) if self.resume_from is not None else {}

    def _setup_data_and_model(self) -> None:
        """The samples, the model and the run records. The samples, their paths, the remembered keys and the model
        live as long as the run: no collector pass while they are made (each pass would walk all made so far), then
        kept out of every later pass (`gc.freeze`; a full pass takes a second or more at a million samples)."""
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            self._load_data_and_model()
            gc.freeze()
            self.frozen = True
        finally:
            if gc_was_on:
                gc.enable()

    def _load_data_and_model(self) -> None:
        """The training, regularisation and held-out samples, the loaded model parts and the run records. The
        model's weights load in the background while the data set is scanned and every sample's entries are checked
        (later misses stop the run too); training starts only once both are done."""
        s, accelerator = self.s, self.accelerator
        # Captions written while the data is read build the VL text encoder: the transformer then loads after the
        # data is ready, not beside it (loading builds modules on the meta device through a process-wide switch,
        # which a model built meanwhile would catch).
        writes_captions = s.captions is not None and self.source.encodes
        self.objective_type = objective = objective_class(s.train.objective)
        load = (s.plan, accelerator)
        loading = None if writes_captions else in_background(load_model, *load)
        try:
            # data.auto_caption: cached training reads captions only; live and lazy write the missing ones (the main
            # process first, the others then read them).
            with collecting():  # captions written by a model, one generation after another: their garbage collected
                captions = auto_captions(s.captions, s.source, s.spec, self.source.encodes, self.backend)
            samples = self._read_samples(objective, captions)
            samples, self.reg = ready_data(s, self.source, samples, self.run_dir, accelerator.is_main_process, captions)
            self.samples, self.heldout_samples = split_heldout(samples, s.validation.heldout_samples)
            if loading is None:  # the captions are written (for the regularisation data too)
                loading = in_background(load_model, *load)
        except BaseException:
            if loading is not None:
                loading.wait()  # a thread still inside torch when the interpreter exits aborts it
            raise
        self.parts = loading.result()

    def _read_samples(self, objective: type, captions: Any) -> list:
        """The data set's samples with the fields `objective` trains on, and the run records (checked against the
        checkpoint resumed from)."""
        s, accelerator = self.s, self.accelerator
        fields = run_fields(objective.requires)  # the sample fields it trains on
        with file_stats.once():  # the scan and the key memo share each image's stat
            with accelerator.main_process_first():
                data = dataclasses.replace(s.samples, fields=with_defaults(fields))
                report, targets = accelerator.is_main_process, trains_on_targets(objective)
                samples = load_samples(
                    data,
                    spec=s.spec,
                    report=report,
                    captions=captions,
                    fields=fields,
                    on_missing=s.on_missing,
                    targets=targets,
                )
            self.records = run_records(s.plan, samples)
        if self.resume_from is not None:
            warning = check_resume(self.resumed, self.resume_from, *self.records, s.train.resume_inexact)
            if warning:
                accelerator.print(f"qie: warning: {warning}")
        return samples

    def _setup_state(self) -> None:
        """The objective, the training state over the model (resumed where a checkpoint is given) and the EMA."""
        s, train, parts = self.s, self.s.train, self.parts
        stores = functools.partial(objective_store, self.backend, mode=str(s.source.mode))
        key = base_model_key(s.model, self.records[0])
        rows = sample_rows(self.samples + self.heldout_samples, s.spec)
        self.context = context = objective_context(s.plan, parts, stores, key, rows)
        self.state, self.objective = build_train_state(s.plan, self.accelerator, parts, make_objective(s.plan, context))
        context.sealed = True  # the model is wrapped: nothing more is added to it
        self.scheduler = parts.scheduler
        self.ema = make_ema(train, self.state.params)
        if self.resume_from is not None:
            step = ckpt.load_checkpoint(self.state, self.resume_from, train.resume_inexact)["step"]
            restore_kept(self.resume_from, context.kept())
            self.state.start_step = int(step)
            if self.ema is not None:
                resume_ema(self.ema, self.resume_from, train.resume_inexact)
            self.accelerator.print(f"qie: resumed from {self.resume_from} at step {self.state.start_step}")
        elif train.resume == "latest":
            where = s.outputs.where(self.run_dir)
            self.accelerator.print(f"qie: train.resume=latest: no checkpoint in {where}, starting from step 0")

    def _setup_loader(self) -> None:
        """The batch stream: the sampler over the training (and regularisation) samples from where a resumed run
        stopped, the dataset reading their embeddings and the loader."""
        s, train, samples, reg = self.s, self.s.train, self.samples, self.reg
        start = int(self.resumed.get("batches_consumed", 0))
        sampler = make_sampler(s, samples, self.accelerator, start=start, extra=reg)
        self.negatives = "empty_prompt" in field_names(self.objective_type)
        dataset = EmbeddingDataset(
            samples + reg,
            self.source,
            caption_dropout_rate=s.data.caption_dropout_rate,
            seed=train.seed,
            control_dropout_rate=s.dropout,
            weighted_from=len(samples) if reg else None,
            weight=s.regularization.weight if reg else 1.0,
            negatives=self.negatives,
        )
        workers, prefetch, parallel = loader_settings(s.data.num_workers, s.data.prefetch, self.source)
        self.loader = make_loader(dataset, sampler, workers, train.seed, prefetch, parallel)

    def _setup_hooks(self) -> None:
        """The metrics logger, what runs after each step and how checkpoints are saved."""
        s, state, run_dir = self.s, self.state, self.run_dir
        resume_step = state.start_step if s.train.resume else None
        main = self.accelerator.is_main_process
        self.logger = MetricsLogger(run_dir, str(s.logging.report_to), main, s.run_config, resume_step=resume_step)
        trained = self.samples + self.reg
        run = HookInputs(
            setup=s,
            state=state,
            source=self.source,
            samples=trained,
            heldout=self.heldout_samples,
            scheduler=self.scheduler,
            logger=self.logger,
            run_dir=run_dir,
        )
        self.hooks = step_hooks(dataclasses.replace(run, ema=self.ema), self.on_step_end)
        self.heldout = HeldOut(state, self.source, self.heldout_samples, self.objective, self.logger, self.negatives)
        if self.heldout_samples and s.validation.every > 0:
            self.hooks.append(self.heldout.hook(s.validation.every))
        if self.reg:
            self.hooks.append(regularization_logging(self.logger, s.regularization.weight))
        saving = Checkpoints(
            state=state,
            run_dir=run_dir,
            mode=s.mode,
            train=s.train,
            records=self.records,
            ema=self.ema,
            run_id=s.outputs.run_id,
            kept=self.context.kept(),
        )
        self.save = s.outputs.saving(saving.save, self.accelerator, run_dir, s.train.checkpoints_total_limit)

    def _close_logger(self) -> None:
        if self.logger is not None:
            self.logger.close()
            self.logger = None

    def _unfreeze(self) -> None:
        if self.frozen:
            gc.unfreeze()  # collectable again once the run is over
            self.frozen = False


@contextmanager
def collecting() -> Iterator[None]:
    """The garbage collector on within the block (in a start-up that pauses it while the data is read)."""
    was_on = gc.isenabled()
    gc.enable()
    try:
        yield
    finally:
        if not was_on:
            gc.disable()


__all__ = ["RESULT_FILE", "TRACEBACK_FILE", "TrainRecipe", "run", "start"]
