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
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from qie import run_lock
from qie.cache.base import CacheBackend
from qie.components import prepare_model
from qie.config import precompute_command, typed, validate
from qie.config.backend import build_backend
from qie.config.train import TrainConfig
from qie.data import file_stats
from qie.data.fields import run_fields, with_defaults
from qie.errors import ConfigError, Interrupted, check_writable
from qie.runtime.memory import full_tensor
from qie.stages.accelerator import make_accelerator
from qie.stages.auto_caption import auto_captions
from qie.stages.background import in_background
from qie.stages.heldout import heldout_hook, measure_heldout, split_heldout
from qie.stages.recipes import lora_exports, make_ema, regularization_logging
from qie.stages.run_outputs import RunOutputs
from qie.stages.sources import build_source
from qie.stages.teacher_store import teacher_store
from qie.stages.train_data import load_samples, loader_settings, make_sampler, ready_data, sample_views
from qie.stages.train_hooks import search_result, step_hooks
from qie.stages.train_model import (
    base_model_key,
    build_train_state,
    load_model,
    loop_settings,
    make_objective,
    run_records,
)
from qie.stages.train_report import record_run, refresh_report
from qie.stages.train_setup import TrainSetup, train_setup
from qie.training import checkpoint as ckpt
from qie.training.batches import EmbeddingDataset, make_loader, raise_failures
from qie.training.ema import Ema, export_ema, resume_ema, write_ema
from qie.training.logging import MetricsLogger
from qie.training.loop import StepInfo, TrainState, fit
from qie.training.modes import TrainMode
from qie.training.objectives import field_names, needs_decoder, objective_class, trains_on_targets
from qie.training.run_record import check_resume
from qie.types import TRAINING_TYPES

RESULT_FILE = "train_result.json"


def run(cfg: DictConfig, run_dir: Path, on_step_end: Callable[[StepInfo], None] | None = None) -> dict:
    """Train as `cfg` says, writing metrics, TensorBoard logs, checkpoints and the weights under `run_dir`.

    The stage's edge: the one place that reads `cfg`, turned into a `TrainSetup` (checked before anything loads).

    Args:
        on_step_end: an extra hook after each optimizer step (benchmarks time steps with it).

    Returns:
        The result also written to train_result.json: step, loss, losses, stopped_by_signal, lora, ...

    Raises:
        QieError subclasses for what a user can fix (config, data, cache misses, models), and StorageError when
        another process trains in `run_dir` (one writer per run folder, see `qie.run_lock`).
    """
    validate(cfg)  # the config-only rules, for a config changed in code after it was composed too
    if not cfg.data.path:
        raise ConfigError("data.path is not set: point it at a data set folder or manifest")
    run_dir = Path(run_dir)
    model = typed(cfg.model)
    spec = prepare_model(model)  # first: a checkpoint of another model is named before anything else
    groups = (typed(cfg[k]) for k in ("data", "cache", "train", "predict", "logging", "validation"))
    setup = train_setup(spec, model, *groups, precompute_command(cfg), OmegaConf.to_container(cfg, resolve=True))
    setup = dataclasses.replace(setup, outputs=RunOutputs.of(typed(cfg.run)))
    accelerator = make_accelerator(setup.train, setup.memory, str(model.dtype), run_dir)
    writer = accelerator.is_main_process
    if writer:
        check_writable(run_dir, "the run directory (hydra.run.dir)")
        run_lock.acquire(run_dir)
    try:
        record_run(run_dir, cfg, setup.run_config, accelerator)
        # A backend whose start-up check reads an index starts reading it now, beside the data set's scan.
        ahead = TRAINING_TYPES if str(setup.source.mode) == "cached" else ()
        return _train(setup, run_dir, accelerator, build_backend(cfg.cache, read_ahead=ahead), on_step_end)
    finally:
        if writer:
            run_lock.release(run_dir)


def _train(
    s: TrainSetup,
    run_dir: Path,
    accelerator: Any,
    backend: CacheBackend,
    on_step_end: Callable[[StepInfo], None] | None,
) -> dict:
    train = s.train
    resume_from = s.outputs.resume_from(train.resume, run_dir, accelerator)
    resumed = ckpt.read_state(resume_from) if resume_from is not None else {}
    source = build_source(s.source, s.spec, backend)
    # The samples, their paths, the remembered keys and the model live as long as the run: no collector pass while
    # they are made (each pass would walk all made so far), then kept out of every later pass (`gc.freeze`; a full
    # pass takes a second or more at a million samples: while the adapter is added, the first epoch is drawn, and
    # on the training thread).
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        samples, reg, heldout, parts, records = _data_and_model(
            s, source, backend, accelerator, run_dir, resume_from, resumed
        )
        gc.freeze()
    finally:
        if gc_was_on:
            gc.enable()
    try:
        result, state, ema = _fit(
            s,
            run_dir,
            accelerator,
            backend,
            source,
            (samples, reg, heldout),
            parts,
            records,
            resume_from,
            resumed,
            on_step_end,
        )
    finally:
        gc.unfreeze()  # collectable again once the run is over
    finish(state, s.mode, run_dir, result, lora_exports(train), ema)
    s.outputs.publish(run_dir, accelerator)
    return result


def _fit(
    s: TrainSetup,
    run_dir: Path,
    accelerator: Any,
    backend: CacheBackend,
    source: Any,
    data: tuple,
    parts: Any,
    records: tuple,
    resume_from: Path | None,
    resumed: dict,
    on_step_end: Callable[[StepInfo], None] | None,
) -> tuple[dict, Any, Any]:
    """Build the training state and the batch stream from `data` (the training, regularisation and held-out
    samples), and train; returns (the result, the state, the EMA weights or None) for `finish`."""
    train, (samples, reg, heldout) = s.train, data
    teachers = teacher_store(backend, s.source.mode)
    key, views = base_model_key(s.model, records[0]), sample_views(samples + heldout)
    objective = make_objective(train, parts.scheduler, s.spec, parts.pipeline_config, teachers, key, parts.vae, views)
    state, scheduler = build_train_state(s.model, train, s.memory, s.mode, accelerator, s.spec, parts, objective)
    ema = make_ema(train, state.params)
    sampler = make_sampler(s, samples, accelerator, start=int(resumed.get("batches_consumed", 0)), extra=reg)
    if resume_from is not None:
        state.start_step = int(ckpt.load_checkpoint(state, resume_from, bool(train.resume_inexact))["step"])
        if ema is not None:
            resume_ema(ema, resume_from, bool(train.resume_inexact))
        accelerator.print(f"qie: resumed from {resume_from} at step {state.start_step}")
    elif train.resume == "latest":
        where = s.outputs.where(run_dir)
        accelerator.print(f"qie: train.resume=latest: no checkpoint in {where}, starting from step 0")

    reg_weight = s.regularization.weight if reg else 1.0
    negatives = "empty_prompt" in field_names(objective_class(train.objective))
    dataset = EmbeddingDataset(
        samples + reg,
        source,
        float(s.data.caption_dropout_rate),
        int(train.seed),
        s.dropout,
        len(samples) if reg else None,
        reg_weight,
        negatives,
    )
    workers, prefetch, parallel = loader_settings(int(s.data.num_workers), int(s.data.prefetch), source)
    loader = make_loader(dataset, sampler, workers, int(train.seed), prefetch, parallel)
    logger = MetricsLogger(
        run_dir,
        str(s.logging.report_to),
        accelerator.is_main_process,
        s.run_config,
        resume_step=state.start_step if train.resume else None,
    )
    hooks = step_hooks(s, state, source, (samples + reg, heldout), scheduler, logger, on_step_end, run_dir, ema)
    if heldout and int(s.validation.every) > 0:
        hooks.append(heldout_hook(state, source, heldout, objective, logger, int(s.validation.every), negatives))
    if reg:
        hooks.append(regularization_logging(logger, reg_weight))
    save = functools.partial(_save_checkpoint, state, run_dir, s.mode, train, records, ema)
    save = s.outputs.saving(save, accelerator, run_dir, train.checkpoints_total_limit)
    try:
        settings = loop_settings(train, s.logging, objective)
        result = fit(
            state,
            raise_failures(loader),
            settings,
            logger,
            save_checkpoint=save,
            on_step_end=lambda info: [hook(info) for hook in hooks],
            last_saved=resume_from,
        )
        measure_heldout(result, state, source, heldout, objective, logger, negatives)
        result.update(search_result(s.validation, run_dir))
    except Interrupted as e:  # a second stop signal: name what is kept, now that an unfinished save is removed
        raise Interrupted(ckpt.kept_after_interrupt(run_dir, resume_from), e.signum) from None
    finally:
        logger.close()
    return result, state, ema


def _data_and_model(
    s: TrainSetup, source: Any, backend: Any, accelerator: Any, run_dir: Path, resume_from: Path | None, resumed: dict
) -> tuple:
    """The training samples, the regularisation samples, the held-out samples, the loaded model parts and the run
    records. The model's weights load in the background while the data set is scanned and every sample's entries
    are checked (later misses stop the run too); training starts only once both are done."""
    # Captions written while the data is read build the VL text encoder: the transformer then loads after the data
    # is ready, not beside it (loading builds modules on the meta device through a process-wide switch, which a
    # model built meanwhile would catch).
    writes_captions = s.captions is not None and source.encodes
    objective = objective_class(s.train.objective)
    load = (s.model, s.memory, bool(s.train.compile), accelerator, s.spec, s.fused, needs_decoder(objective))
    loading = None if writes_captions else in_background(load_model, *load)
    try:
        # data.auto_caption: cached training reads captions only; live and lazy write the missing ones (the main
        # process first, the others then read them).
        with collecting():  # captions written by a model, one generation after another: their garbage collected
            captions = auto_captions(s.captions, s.source, s.spec, source.encodes, backend)
        fields = run_fields(objective.requires)  # the sample fields it trains on
        with file_stats.once():  # the scan and the key memo share each image's stat
            with accelerator.main_process_first():
                data = dataclasses.replace(s.samples, fields=with_defaults(fields))
                report, targets = accelerator.is_main_process, trains_on_targets(objective)
                samples = load_samples(data, s.spec, report, captions, fields, s.on_missing, targets)
            records = run_records(s.model, s.train, s.spec, samples, s.fused)
            if resume_from is not None:
                warning = check_resume(resumed, resume_from, *records, bool(s.train.resume_inexact))
                if warning:
                    accelerator.print(f"qie: warning: {warning}")
            samples, reg = ready_data(s, source, samples, run_dir, accelerator.is_main_process, captions)
        samples, heldout = split_heldout(samples, int(s.validation.heldout_samples))
        if loading is None:  # the captions are written (for the regularisation data too)
            loading = in_background(load_model, *load)
    except BaseException:
        if loading is not None:
            loading.wait()  # a thread still inside torch when the interpreter exits aborts it
        raise
    return samples, reg, heldout, loading.result(), records


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


def _save_checkpoint(
    state: TrainState,
    run_dir: Path,
    mode: TrainMode,
    train: TrainConfig,
    records: tuple[dict, dict],
    ema: Ema | None,
    step: int,
    consumed: int,
) -> Path:
    info = {
        "step": step,
        "batches_consumed": consumed,
        "num_processes": state.accelerator.num_processes,
        "model": records[0],
        "data": records[1],
    }
    exports, model = lora_exports(train), state.accelerator.unwrap_model(state.model)
    extra = (lambda folder: write_ema(ema, folder, model, exports, mode.base)) if ema is not None else None
    folder = ckpt.save_checkpoint(state, run_dir, info, mode, exports, train.checkpoints_total_limit, extra)
    if step < int(train.max_steps):  # the last step's report is written by `finish`, with the run's result
        refresh_report(run_dir, state.accelerator)
    return folder


def finish(
    state: TrainState, mode: TrainMode, run_dir: Path, result: dict, exports: tuple[str, ...], ema: Ema | None = None
) -> None:
    """Check the replicas agree, export the trained weights and write train_result.json (main process)."""
    accelerator = state.accelerator
    result["param_checksums"] = _gather_checksums(accelerator, state.params)
    result["ranks_agree"] = all(c == result["param_checksums"][0] for c in result["param_checksums"])
    key, path = mode.export(accelerator.unwrap_model(state.model), run_dir, exports, write=accelerator.is_main_process)
    if accelerator.is_main_process:
        result[key] = str(path)
        if ema is not None:  # beside the raw LoRA: lora/ema/
            model = accelerator.unwrap_model(state.model)
            result["ema_lora"] = str(export_ema(ema, path.parent, model, exports, mode.base))
        (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2))
        report = refresh_report(run_dir, accelerator)
        if not result["ranks_agree"]:
            print(f"qie: warning: the processes' weights differ at the end: {result['param_checksums']}")
        how = f"stopped by signal {result['signal']}" if result["stopped_by_signal"] else "trained"
        last = f"last loss {result['loss']:.4f}" if result["losses"] else "no step left (train.max_steps reached)"
        print(f"qie: {how} at step {result['step']}, {last}; weights: {path}")
        if result["stopped_by_signal"]:
            print(f"qie: continue with train.resume=latest hydra.run.dir={run_dir}")
        print(f"qie: metrics {run_dir / 'metrics.jsonl'}, TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
        if report is not None:
            print(f"qie: report {report}")
    # Free the DDP wrapper while the process group is still registered: a gloo group whose last owner is
    # DDP's reducer is destroyed holding the GIL, which deadlocks with gloo's threads (pytorch#56297).
    state.model = None
    accelerator.free_memory()
    accelerator.end_training()


def _gather_checksums(accelerator: Any, params: list[torch.nn.Parameter]) -> list[list[float]]:
    """Per process, the sum and the sum of squares of the trained weights: equal when replicas agree."""
    trained = [full_tensor(p.detach()).double() for p in params if p.requires_grad]
    local = torch.stack([torch.stack([p.sum(), p.pow(2).sum()]) for p in trained]).sum(0)
    gathered = accelerator.gather(local.to(accelerator.device).unsqueeze(0))
    return gathered.cpu().tolist()


__all__ = ["RESULT_FILE", "run"]
