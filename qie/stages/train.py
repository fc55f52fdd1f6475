"""The train stage: build the transformer (+LoRA), the embedding source and the loop, then run it.

Cached mode builds only the transformer and scheduler: never the text encoder or the VAE (logged images are read
from the sample files); live and lazy modes build the encoders too. Loss masks are read and checked at start.

Run it with `python -m qie.train ...`; `accelerate launch` (or `torchrun`) runs it data-parallel. A Hydra
sweep (`python -m qie.train -m train.learning_rate=1e-4,3e-4`) gives each job its own run directory
(`multirun/<date>/<time>/<job number>`); to send the jobs to a Slurm cluster, install `qie[slurm]` and
add `hydra/launcher=submitit_slurm hydra.launcher.gpus_per_node=1 hydra.launcher.timeout_min=600`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from qie import run_lock
from qie.components import load_parts, prepare_model, resolve_dtype
from qie.data.buckets import BucketBatchSampler, bucket_keys
from qie.data.mixing import MixedBatchSampler
from qie.data.samples import DataProblem, Sample, without_controls
from qie.embeddings import EmbeddingSource
from qie.errors import CacheMissError, ConfigError, DataError, check_writable
from qie.models import ModelSpec
from qie.readiness import ready_samples
from qie.stages.auto_caption import caption_settings
from qie.stages.common import (
    auto_captions,
    build_source,
    check_masks,
    control_dropout,
    in_background,
    precompute_command,
    read_data,
    value,
    warn_single_process,
)
from qie.stages.recipes import (
    check_recipes,
    lora_exports,
    make_ema,
    regularization_logging,
    regularization_samples,
    weighted,
)
from qie.training import checkpoint as ckpt
from qie.training.adapters import check_options
from qie.training.batches import EmbeddingDataset, make_loader, raise_failures
from qie.training.compile import compile_blocks
from qie.training.ema import Ema, export_ema, resume_ema, write_ema
from qie.training.logging import ImageLogger, MetricsLogger
from qie.training.lookups import remember_package_lookups
from qie.training.loop import LoopSettings, StepInfo, TrainState, fit
from qie.training.lora import check_init_name, check_lora_file
from qie.training.memory import MemorySettings, apply_memory, enable_fsdp_on_cpu, full_tensor
from qie.training.modes import FullMode, LoraMode, TrainMode
from qie.training.run_record import check_resume, data_record, model_record, transformer_fingerprint
from qie.training.timesteps import SigmaSampling

RESULT_FILE = "train_result.json"


def run(cfg: DictConfig, run_dir: Path, on_step_end: Callable[[StepInfo], None] | None = None) -> dict:
    """Train as `cfg` says, writing metrics, TensorBoard logs, checkpoints and the weights under `run_dir`.

    Args:
        on_step_end: an extra hook after each optimizer step (benchmarks time steps with it).

    Returns:
        The result also written to train_result.json: step, loss, losses, stopped_by_signal, lora, ...

    Raises:
        QieError subclasses for what a user can fix (config, data, cache misses, models), and StorageError when
        another process trains in `run_dir` (one writer per run folder, see `qie.run_lock`).
    """
    if not cfg.data.path:
        raise ConfigError("data.path is not set: point it at a data set folder or manifest")
    run_dir = Path(run_dir)
    spec = prepare_model(cfg.model)  # first: a checkpoint of another model is named before anything else
    mode = train_mode(cfg.train, spec)  # checks train.lora.init and reads train.init_lora before anything is built
    check_recipes(cfg, mode.lora)  # train.mask, ema, data.control_dropout_rate, regularization: before reading
    if cfg.data.get("auto_caption", False):
        caption_settings(cfg.data, spec)  # a caption prompt that cannot be read: before anything is built
    accelerator = make_accelerator(cfg.train, str(value(cfg.model.dtype)), run_dir, spec)
    writer = accelerator.is_main_process
    if writer:
        check_writable(run_dir, "the run directory (hydra.run.dir)")
        run_lock.acquire(run_dir)
    try:
        return _train(cfg, run_dir, accelerator, spec, mode, on_step_end)
    finally:
        if writer:
            run_lock.release(run_dir)


def _train(cfg: DictConfig, run_dir: Path, accelerator: Any, spec: ModelSpec, mode: TrainMode,
           on_step_end: Callable[[StepInfo], None] | None) -> dict:  # fmt: skip
    resume_from = ckpt.resolve_resume(cfg.train.resume, run_dir)
    resumed = ckpt.read_state(resume_from) if resume_from is not None else {}
    source = build_source(cfg, precompute_command=precompute_command(cfg), spec=spec)
    # The model's weights load in the background while the data set is scanned and every sample's entries are
    # checked (later misses stop the run too); training starts only once both are done.
    MemorySettings.of(cfg.train, spec.family).check(mode.lora, str(value(cfg.model.quantize)))
    # Captions written while the data is read build the VL text encoder: the transformer then loads after the data
    # is ready, not beside it (loading builds modules on the meta device through a process-wide switch, which a
    # model built meanwhile would catch).
    writes_captions = bool(cfg.data.get("auto_caption", False)) and source.encodes
    loading = None if writes_captions else in_background(load_model, cfg.model, cfg.train, accelerator, spec)
    try:
        # data.auto_caption: cached training reads captions only; live and lazy write the missing ones (the main
        # process first, the others then read them).
        captions = auto_captions(cfg, spec, source.encodes)
        with accelerator.main_process_first():
            samples = load_samples(cfg, spec, accelerator.is_main_process, captions)
        records = run_records(cfg, spec, samples)
        if resume_from is not None:
            warning = check_resume(resumed, resume_from, *records, bool(cfg.train.resume_inexact))
            if warning:
                accelerator.print(f"qie: warning: {warning}")
        samples, reg = ready_data(cfg, spec, source, samples, run_dir, accelerator.is_main_process, captions)
        if loading is None:  # the captions are written (for the regularisation data too)
            loading = in_background(load_model, cfg.model, cfg.train, accelerator, spec)
    except BaseException:
        if loading is not None:
            loading.wait()  # a thread still inside torch when the interpreter exits aborts it
        raise
    state, scheduler = build_train_state(cfg.model, cfg.train, mode, accelerator, spec, loading.result())
    ema = make_ema(cfg.train, state.params)
    sampler = make_sampler(cfg, samples, accelerator, start=int(resumed.get("batches_consumed", 0)), extra=reg)
    if resume_from is not None:
        state.start_step = int(ckpt.load_checkpoint(state, resume_from, bool(cfg.train.resume_inexact))["step"])
        if ema is not None:
            resume_ema(ema, resume_from, bool(cfg.train.resume_inexact))
        accelerator.print(f"qie: resumed from {resume_from} at step {state.start_step}")
    elif cfg.train.resume == "latest":
        accelerator.print(f"qie: train.resume=latest: no checkpoint in {run_dir}, starting from step 0")

    reg_weight = float(cfg.data.regularization.weight) if reg else 1.0
    dataset = EmbeddingDataset(samples + reg, source, float(cfg.data.caption_dropout_rate), int(cfg.train.seed),
                               control_dropout(cfg), len(samples) if reg else None, reg_weight)  # fmt: skip
    workers, prefetch = loader_settings(cfg.data, source)
    loader = make_loader(dataset, sampler, workers, int(cfg.train.seed), prefetch)
    logger = MetricsLogger(run_dir, str(value(cfg.logging.report_to)), accelerator.is_main_process,
                           OmegaConf.to_container(cfg, resolve=True),
                           resume_step=state.start_step if cfg.train.resume else None)  # fmt: skip
    hooks = step_hooks(cfg, spec, state, source, samples + reg, scheduler, logger, on_step_end, run_dir, ema)
    if reg:
        hooks.append(regularization_logging(logger, reg_weight))
    save = functools.partial(_save_checkpoint, state, run_dir, mode.lora, cfg.train, records, ema)
    # The samples, their paths, the remembered keys and the model live as long as the run: kept out of the
    # garbage collector's full passes (each a few seconds at a million samples, on the training thread).
    gc.freeze()
    try:
        settings = loop_settings(cfg.train, cfg.logging, scheduler, spec)
        if reg:  # regularisation batches weigh data.regularization.weight
            settings = dataclasses.replace(settings, loss=weighted(settings.loss))
        result = fit(state, raise_failures(loader), settings, logger, save_checkpoint=save,
                     on_step_end=lambda info: [hook(info) for hook in hooks], last_saved=resume_from)  # fmt: skip
    finally:
        logger.close()
        gc.unfreeze()  # collectable again once the run is over
    finish(state, mode, run_dir, result, lora_exports(cfg.train), ema)
    return result


def make_accelerator(train: DictConfig, model_dtype: str, run_dir: Path, spec: ModelSpec) -> Any:
    """The run's Accelerator, seeded with `train.seed` (FSDP shards the family's transformer blocks)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    remember_package_lookups()
    memory = MemorySettings.of(train, spec.family)
    accelerator = Accelerator(
        # Without CUDA, accelerate joins the processes of torchrun / `accelerate launch` only when told it
        # is on the CPU; otherwise each process would train alone.
        cpu=not torch.cuda.is_available(),
        mixed_precision=mixed_precision(str(value(train.mixed_precision)), model_dtype),
        gradient_accumulation_steps=int(train.gradient_accumulation_steps),
        project_dir=str(run_dir),
        **memory.accelerator_kwargs(),
    )
    enable_fsdp_on_cpu(accelerator, memory)
    set_seed(int(train.seed))
    warn_single_process(accelerator.num_processes, "qie.train")
    return accelerator


def mixed_precision(setting: str, model_dtype: str) -> str:
    """`train.mixed_precision`, with "auto" meaning bf16 on CUDA for a bf16 model and "no" otherwise."""
    if setting == "auto":
        return "bf16" if torch.cuda.is_available() and model_dtype == "bfloat16" else "no"
    return setting


def load_samples(cfg: DictConfig, spec: ModelSpec, report: bool, captions: Any = None) -> list[Sample]:
    """The samples of `data.path` the model can take; the first problems found are printed when `report`.
    `captions` (`data.auto_caption`) gives samples without a caption theirs.

    Raises:
        DataError: no sample is usable with this model (e.g. an edit data set for a text-to-image model).
        CacheMissError: a caption the cache lacks (cache-only captions, `cache.on_missing=stop`).
    """
    data, dataset = cfg.data, read_data(cfg, captions=captions)
    if captions is not None and captions.misses and str(value(cfg.cache.on_missing)) == "stop":
        first = captions.misses[0]
        raise CacheMissError(f"{len(captions.misses)} samples have no cached caption, the first {first.id!r} "
                             f"({first.path}): {first.reason.split(': ', 1)[-1]} "
                             "(or cache.on_missing=skip trains on the rest)")  # fmt: skip
    problems = [
        DataProblem(s.id, str(s.target), why)
        for s in dataset.samples
        if (why := spec.control_problem(len(s.controls)) or spec.layers_problem(len(s.layers)))
    ]
    skipped = {p.id for p in problems}
    samples = [s for s in dataset.samples if s.id not in skipped]
    problems = dataset.problems + problems
    if not samples:
        raise DataError(f"no sample of {data.path} can train model={spec.name}: {problems[0].reason}")
    for p in problems[:5] if report else []:
        print(f"qie: skipping sample {p.id!r}: {p.path}: {p.reason}")
    return samples


def ready_data(cfg: DictConfig, spec: ModelSpec, source: EmbeddingSource, samples: list[Sample], run_dir: Path,
               report: bool, captions: Any = None) -> tuple[list[Sample], list[Sample]]:  # fmt: skip
    """The `samples` and the regularisation set's samples whose cache entries are all there (`ready_samples`;
    with reference dropout, their text-only entries too)."""
    on_missing, cache_dir, command = str(value(cfg.cache.on_missing)), cfg.cache.get("dir"), precompute_command(cfg)
    samples = ready_samples(source, samples, run_dir, on_missing, cache_dir, report, command)
    reg = regularization_samples(cfg, spec, captions)
    reg = ready_samples(source, reg, run_dir, on_missing, cache_dir, False, command) if reg else []
    if control_dropout(cfg):  # the text-only entries too
        kept = {s.id for s in ready_samples(source, [without_controls(s) for s in samples + reg], run_dir,
                                            on_missing, cache_dir, False, command)}  # fmt: skip
        samples, reg = [s for s in samples if s.id in kept], [s for s in reg if s.id in kept]
    return check_masks(source, samples, report), reg  # each loss mask read and checked at start


def loader_settings(data: DictConfig, source: EmbeddingSource) -> tuple[int, int]:
    """(worker processes, prefetched batches) of the training loader: `data.num_workers` and `data.prefetch` for
    a source that only reads, none for one that encodes (its encoders are not run ahead of the step)."""
    return (0, 0) if source.encodes else (int(data.num_workers), int(data.prefetch))


def train_mode(train: DictConfig, spec: ModelSpec) -> TrainMode:
    """The strategy `train.mode` names, with `train.lora`'s settings for a LoRA (or `train.init_lora`'s file).

    Raises:
        ConfigError, ModelLoadError: a `train.lora.init` peft does not know; an unreadable `train.init_lora`.
    """
    if str(value(train.mode)) == "full":
        if train.get("init_lora"):
            raise ConfigError("train.init_lora needs train.mode=lora (it names a LoRA to go on training)")
        return FullMode()
    lora, init_lora = train.lora, train.get("init_lora")
    adapter, use_dora = str(value(train.get("adapter", "lora"))), bool(lora.get("use_dora", False))
    check_init_name(str(lora.init))
    check_options(adapter, float(lora.dropout), str(lora.init), use_dora)
    if init_lora:
        check_lora_file(init_lora, spec.family.lora_loader_class())  # before any model is built
    return LoraMode(int(lora.rank), int(lora.alpha), list(lora.target_modules), float(lora.dropout), str(lora.init),
                    str(init_lora) if init_lora else None, adapter, use_dora)  # fmt: skip


def loop_settings(train: DictConfig, logging: DictConfig, scheduler: Any, spec: ModelSpec) -> LoopSettings:
    sigmas = SigmaSampling(
        method=str(value(train.timestep_sampling)),
        logit_mean=float(train.logit_mean),
        logit_std=float(train.logit_std),
        mode_scale=float(train.mode_scale),
        shift=float(train.shift),
        dynamic_shift=bool(train.dynamic_shift),
        scheduler_config=dict(scheduler.config),
    )
    return LoopSettings(
        max_steps=int(train.max_steps),
        seed=int(train.seed),
        max_grad_norm=float(train.max_grad_norm),
        checkpoint_every=int(train.checkpoint_every),
        log_every=int(logging.log_every),
        sigmas=sigmas,
        loss_weighting=str(value(train.loss_weighting)),
        on_nonfinite=str(value(train.on_nonfinite)),
        loss=spec.loss,
        patch_size=spec.family.patch_size,
    )


def load_model(model: DictConfig, train: DictConfig, accelerator: Any, spec: ModelSpec) -> Any:
    """The transformer and the noise scheduler, built where `train`'s memory settings build them."""
    device = MemorySettings.of(train, spec.family).build_device(accelerator.device)
    return load_parts(model, ["transformer", "scheduler"], {"transformer": device}, spec)


def build_train_state(model: DictConfig, train: DictConfig, mode: TrainMode, accelerator: Any, spec: ModelSpec,
                      parts: Any = None) -> tuple:  # fmt: skip
    """The prepared transformer with what `mode` trains, its optimizer and LR schedule; and the noise scheduler.

    Args:
        parts: what `load_model` gave (loaded here when None).
    """
    memory = MemorySettings.of(train, spec.family)
    memory.check(mode.lora, str(value(model.quantize)))
    parts = parts if parts is not None else load_model(model, train, accelerator, spec)
    transformer = parts.transformer
    params = mode.trainable(transformer)
    place = apply_memory(transformer, memory, accelerator.device)
    if train.get("compile", False):
        accelerator.print(compile_blocks(transformer))
    optimizer = _instantiate(train.optimizer)(params, lr=float(train.learning_rate))
    lr_scheduler = _instantiate(train.lr_scheduler)(optimizer)
    # The LR scheduler is not prepared: accelerate would step it once per process. Checkpoints save it.
    prepared, optimizer = accelerator.prepare(transformer, optimizer, device_placement=[place, True])
    params = [p for p in prepared.parameters() if p.requires_grad]  # FSDP replaces them by their shards
    dtype = resolve_dtype(str(value(model.dtype)))
    return TrainState(accelerator, prepared, params, optimizer, lr_scheduler, dtype), parts.scheduler


def run_records(cfg: DictConfig, spec: ModelSpec, samples: list[Sample]) -> tuple[dict, dict]:
    """The model and data records checkpoints keep, and resume compares (see `qie.training.run_record`)."""
    m, train = cfg.model, cfg.train
    fingerprint = transformer_fingerprint(str(m.pretrained_model_name_or_path), m.get("transformer_path"), m.revision)
    lora = None
    if str(value(train.mode)) != "full":
        keys = ("rank", "alpha", "target_modules", "dropout", "init")
        lora = {k: OmegaConf.to_container(v) if OmegaConf.is_config(v := train.lora[k]) else value(v) for k in keys}
    return model_record(spec, fingerprint, str(value(train.mode)), lora), data_record([s.id for s in samples])


def _save_checkpoint(state: TrainState, run_dir: Path, lora: bool, train: DictConfig, records: tuple[dict, dict],
                     ema: Ema | None, step: int, consumed: int) -> Path:  # fmt: skip
    info = {"step": step, "batches_consumed": consumed, "num_processes": state.accelerator.num_processes,
            "model": records[0], "data": records[1]}  # fmt: skip
    exports, model = lora_exports(train), state.accelerator.unwrap_model(state.model)
    extra = (lambda folder: write_ema(ema, folder, model, exports)) if ema is not None else None
    return ckpt.save_checkpoint(state, run_dir, info, lora, exports, train.checkpoints_total_limit, extra)


def _instantiate(node: Any) -> Any:
    from hydra.utils import instantiate

    return instantiate(node)


def make_sampler(
    cfg: DictConfig, samples: list[Sample], accelerator: Any, start: int, extra: list[Sample] | None = None
) -> BucketBatchSampler | MixedBatchSampler:
    """The resumable batch stream of this process, bucketed by latent shapes when batches hold several samples;
    with `extra` (regularisation samples, after `samples` in the dataset) mixed in by `data.regularization.ratio`."""
    if extra:
        main, other = make_sampler(cfg, samples, accelerator, 0), make_sampler(cfg, extra, accelerator, 0)
        ratio, accumulation = float(cfg.data.regularization.ratio), int(cfg.train.gradient_accumulation_steps)
        return MixedBatchSampler(main, other, len(samples), ratio, int(cfg.train.seed), accumulation, start)
    batch_size = int(cfg.data.batch_size)
    # Batches of one never mix shapes: skip reading every image header.
    keys: list = [0] * len(samples)
    if batch_size > 1:
        index = Path(cfg.cache.dir) / "image_sizes.json" if cfg.cache.get("dir") else None
        areas = (int(cfg.data.target_pixels), int(cfg.model.vae_image_pixels), int(cfg.data.multiple_of))
        keys = bucket_keys(samples, *areas, index=index)
    sampler = BucketBatchSampler(keys, [len(s.prompt) for s in samples], batch_size, int(cfg.train.seed),
                                 bool(cfg.data.shuffle), accelerator.num_processes, accelerator.process_index,
                                 start=start)  # fmt: skip
    accelerator.print(f"qie: data: {sampler.summary()}")
    return sampler


def step_hooks(cfg: DictConfig, spec: ModelSpec, state: TrainState, source: Any, samples: list, scheduler: Any,
               logger, extra, run_dir: Path, ema: Ema | None = None) -> list:  # fmt: skip
    """What runs after each optimizer step: the EMA update, image logging, validation sampling, and `extra`."""
    hooks = [lambda info: ema.update(info.step)] if ema is not None else []
    if cfg.logging.log_images:
        log, by_id = cfg.logging, {s.id: s for s in samples}
        images = ImageLogger(logger, by_id, int(log.log_images_every), int(log.log_images_count))
        hooks.append(lambda info: images(info.step, info.batch))
    if int(cfg.validation.every) > 0 and state.accelerator.is_main_process:
        use_ema = ema if cfg.validation.get("use_ema") else None
        hooks.append(_validation_hook(cfg, spec, state, source, samples, scheduler, logger, run_dir, use_ema))
    if extra is not None:
        hooks.append(extra)
    return hooks


def _validation_hook(cfg: DictConfig, spec: ModelSpec, state: TrainState, source: Any, samples: list,
                     scheduler: Any, logger, run_dir: Path, ema: Ema | None = None):  # fmt: skip
    """Every `validation.every` steps, sample the validation inputs as inference does; save (`run_dir/validation`),
    measure and log them.

    Builds the VAE (its decoder decodes the samples); the inputs come through the run's source.
    """
    from qie.stages.common import sampling_options
    from qie.stages.validation import validation_inputs, validation_references, validation_samples
    from qie.training.validation import Validator

    v, accelerator = cfg.validation, state.accelerator
    options = sampling_options(
        cfg.predict, negative_prompt=v.negative_prompt, true_cfg_scale=v.true_cfg_scale,
        num_inference_steps=v.num_inference_steps, seed=v.seed,
    )  # fmt: skip
    vae_parts = load_parts(cfg.model, ["vae"], {"vae": str(accelerator.device)}, spec)
    chosen = validation_samples(v, samples, int(cfg.logging.log_images_count), spec)
    inputs, negatives = validation_inputs(source, chosen, options.negative_prompt)
    validator = Validator(inputs, negatives, scheduler, vae_parts.vae, logger, options, spec, run_dir / "validation",
                          validation_references(chosen, spec), vae_parts.pipeline_config)  # fmt: skip
    every = int(v.every)

    def hook(info: StepInfo) -> None:
        if info.step % every == 0:
            with ema.applied() if ema is not None else contextlib.nullcontext():  # sample with the average
                validator(info.step, accelerator.unwrap_model(state.model))

    return hook


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
            result["ema_lora"] = str(export_ema(ema, path.parent, accelerator.unwrap_model(state.model), exports))
        (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2))
        if not result["ranks_agree"]:
            print(f"qie: warning: the processes' weights differ at the end: {result['param_checksums']}")
        how = f"stopped by signal {result['signal']}" if result["stopped_by_signal"] else "trained"
        last = f"last loss {result['loss']:.4f}" if result["losses"] else "no step left (train.max_steps reached)"
        print(f"qie: {how} at step {result['step']}, {last}; weights: {path}")
        if result["stopped_by_signal"]:
            print(f"qie: continue with train.resume=latest hydra.run.dir={run_dir}")
        print(f"qie: metrics {run_dir / 'metrics.jsonl'}, TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
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


__all__ = ["RESULT_FILE", "precompute_command", "run"]
