"""The train stage: build the transformer (+LoRA), the embedding source and the loop, then run it.

Cached mode builds only the transformer and scheduler: never the text encoder or the VAE (logged images
are read from the sample files). Live and lazy modes build the encoders too.

Run it with `python -m qie.train ...`; `accelerate launch` (or `torchrun`) runs it data-parallel. A Hydra
sweep (`python -m qie.train -m train.learning_rate=1e-4,3e-4`) gives each job its own run directory
(`multirun/<date>/<time>/<job number>`); to send the jobs to a Slurm cluster, install `qie[slurm]` and
add `hydra/launcher=submitit_slurm hydra.launcher.gpus_per_node=1 hydra.launcher.timeout_min=600`.
"""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from qie.components import load_parts, resolve_dtype
from qie.components.quantize import is_quantized
from qie.data.buckets import BucketBatchSampler, bucket_keys
from qie.data.dataset import PREFETCH_BATCHES, EmbeddingDataset, make_loader, raise_failures
from qie.data.samples import Sample, scan_dataset
from qie.errors import ConfigError
from qie.stages.common import build_source, value
from qie.training import checkpoint as ckpt
from qie.training.logging import ImageLogger, MetricsLogger
from qie.training.loop import LoopSettings, fit
from qie.training.lora import LORA_FILE, add_lora, dead_modules, save_lora

RESULT_FILE = "train_result.json"


def mixed_precision(cfg: DictConfig) -> str:
    """`train.mixed_precision`, with "auto" meaning bf16 on CUDA for a bf16 model and "no" otherwise."""
    mp = str(value(cfg.train.mixed_precision))
    if mp == "auto":
        return "bf16" if torch.cuda.is_available() and str(value(cfg.model.dtype)) == "bfloat16" else "no"
    return mp


def loop_settings(cfg: DictConfig, scheduler_config: dict) -> LoopSettings:
    t = cfg.train
    return LoopSettings(
        max_steps=int(t.max_steps),
        seed=int(t.seed),
        max_grad_norm=float(t.max_grad_norm),
        checkpoint_every=int(t.checkpoint_every),
        log_every=int(cfg.logging.log_every),
        timestep_sampling=str(value(t.timestep_sampling)),
        logit_mean=float(t.logit_mean),
        logit_std=float(t.logit_std),
        mode_scale=float(t.mode_scale),
        shift=float(t.shift),
        dynamic_shift=bool(t.dynamic_shift),
        loss_weighting=str(value(t.loss_weighting)),
        scheduler_config=dict(scheduler_config),
    )


def trainable_parameters(cfg: DictConfig, transformer: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Add the LoRA (train.mode=lora) or unfreeze the transformer (full); returns what the optimizer trains.

    Raises:
        ConfigError: full training of a quantized model.
    """
    if str(value(cfg.train.mode)) == "full":
        if is_quantized(transformer):
            raise ConfigError("train.mode=full cannot train quantized weights: set model.quantize=none")
        transformer.requires_grad_(True)
        for name in dead_modules(transformer):
            transformer.get_submodule(name).requires_grad_(False)
        return [p for p in transformer.parameters() if p.requires_grad]
    lora = cfg.train.lora
    return add_lora(transformer, lora.rank, lora.alpha, list(lora.target_modules), lora.dropout, lora.init)


def precompute_command(cfg: DictConfig) -> str:
    """The precompute command that fills the cache this run reads: the CLI's model/data/cache overrides."""
    try:
        from hydra.core.hydra_config import HydraConfig

        given = list(HydraConfig.get().overrides.task)
    except ValueError:  # not under the Hydra CLI: rebuild the essentials from the config
        given = [f"model={cfg.model.name}", f"data.path={cfg.data.path}", f"cache={cfg.cache.name}"]
        given.append(f"cache.dir={cfg.cache.dir}")
    groups = ("model", "data", "cache", "experiment")
    keep = [o for o in given if o.lstrip("+~").split("=")[0].split(".")[0] in groups and "cache.mode" not in o]
    return " ".join(["python -m qie.precompute", *(shlex.quote(o) for o in keep)])


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Train as `cfg` says, writing metrics, TensorBoard logs, checkpoints and the LoRA under `run_dir`.

    Returns:
        The result also written to train_result.json: step, loss, losses, stopped_by_signal, lora, ...

    Raises:
        QieError subclasses for what a user can fix (config, data, cache misses, models).
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if not cfg.data.path:
        raise ConfigError("data.path is not set: point it at a data set folder or manifest")
    run_dir = Path(run_dir)
    accelerator = Accelerator(
        # Without CUDA, accelerate joins the processes of torchrun / `accelerate launch` only when told it
        # is on the CPU; otherwise each process would train alone.
        cpu=not torch.cuda.is_available(),
        mixed_precision=mixed_precision(cfg),
        gradient_accumulation_steps=int(cfg.train.gradient_accumulation_steps),
        project_dir=str(run_dir),
    )
    set_seed(int(cfg.train.seed))
    data = scan_dataset(cfg.data.path, str(value(cfg.data.format)))
    for p in data.problems[:5] if accelerator.is_main_process else []:
        print(f"qie: skipping sample {p.id!r}: {p.path}: {p.reason}")
    samples = data.samples
    resume_from = ckpt.resolve_resume(cfg.train.resume, run_dir)
    if cfg.train.resume == "latest" and resume_from is None:
        accelerator.print(f"qie: train.resume=latest: no checkpoint in {run_dir}, starting from step 0")
    resumed = ckpt.read_state(resume_from) if resume_from is not None else {}
    sampler = _sampler(cfg, samples, accelerator, start=int(resumed.get("batches_consumed", 0)))

    source = build_source(cfg, precompute_command=precompute_command(cfg))
    # Fail on a wrong cache.dir in a second, before the model is built (later misses stop the run).
    source.check([samples[i] for i in next(iter(sampler))[1]])

    model, params, optimizer, lr_scheduler, scheduler = _model_and_optimizer(cfg, accelerator)
    lora_mode = str(value(cfg.train.mode)) == "lora"
    start_step = 0
    if resume_from is not None:
        start_step = int(ckpt.load_checkpoint(accelerator, resume_from)["step"])
        accelerator.print(f"qie: resumed from {resume_from} at step {start_step}")

    dataset = EmbeddingDataset(samples, source, float(cfg.data.caption_dropout_rate), int(cfg.train.seed))
    # Encoders may sit on a GPU, which forked workers cannot use: only cache reads go to workers.
    workers = 0 if source.encodes else int(cfg.data.num_workers)
    prefetch = 0 if source.encodes else PREFETCH_BATCHES
    loader = make_loader(dataset, sampler, workers, int(cfg.train.seed), prefetch)
    config = OmegaConf.to_container(cfg, resolve=True)
    logger = MetricsLogger(run_dir, str(value(cfg.logging.report_to)), accelerator.is_main_process, config)
    hooks = _step_end_hooks(cfg, logger, samples)
    if int(cfg.validation.every) > 0 and accelerator.is_main_process:
        hooks.append(_validation_hook(cfg, accelerator, model, source, samples, scheduler, logger))

    def on_step_end(step: int, batch: Any) -> None:
        for hook in hooks:
            hook(step, batch)

    save_checkpoint = functools.partial(_save_checkpoint, cfg, accelerator, model, run_dir, lora_mode)
    settings = loop_settings(cfg, dict(scheduler.config))
    dtype = resolve_dtype(str(value(cfg.model.dtype)))
    try:
        result = fit(
            accelerator, model, params, optimizer, lr_scheduler, raise_failures(loader), dtype, settings, logger,
            start_step=start_step, save_checkpoint=save_checkpoint, on_step_end=on_step_end,
        )  # fmt: skip
    finally:
        logger.close()
    result["param_checksums"] = _gather_checksums(accelerator, params)
    result["ranks_agree"] = all(c == result["param_checksums"][0] for c in result["param_checksums"])
    if accelerator.is_main_process:
        _finish(cfg, accelerator, model, run_dir, result, lora_mode)
    # Free the DDP wrapper while the process group is still registered: a gloo group whose last owner is
    # DDP's reducer is destroyed holding the GIL, which deadlocks with gloo's threads (pytorch#56297).
    del model, save_checkpoint
    accelerator.free_memory()
    accelerator.end_training()
    return result


def _model_and_optimizer(cfg: DictConfig, accelerator: Any) -> tuple:
    """The prepared transformer (+LoRA), its trained parameters, the optimizer, LR scheduler and noise scheduler."""
    parts = load_parts(cfg.model, ["transformer", "scheduler"], {"transformer": str(accelerator.device)})
    transformer = parts.transformer
    if cfg.train.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    params = trainable_parameters(cfg, transformer)
    optimizer = _instantiate(cfg.train.optimizer)(params, lr=float(cfg.train.learning_rate))
    lr_scheduler = _instantiate(cfg.train.lr_scheduler)(optimizer)
    model, optimizer = accelerator.prepare(transformer, optimizer)
    # Not prepared: accelerate would step it once per process. Registered, so its state is checkpointed.
    accelerator.register_for_checkpointing(lr_scheduler)
    if str(value(cfg.train.mode)) == "lora":
        ckpt.register_lora_state(accelerator)
    return model, params, optimizer, lr_scheduler, parts.scheduler


def _save_checkpoint(
    cfg: DictConfig, accelerator: Any, model: Any, run_dir: Path, lora: bool, step: int, batches_consumed: int
) -> Path:
    state = {"step": step, "batches_consumed": batches_consumed, "num_processes": accelerator.num_processes}
    comfyui, keep = bool(cfg.train.export_comfyui), cfg.train.checkpoints_total_limit
    return ckpt.save_checkpoint(accelerator, model, run_dir, state, lora, comfyui, keep)


def _instantiate(node: Any) -> Any:
    from hydra.utils import instantiate

    return instantiate(node)


def _sampler(cfg: DictConfig, samples: list[Sample], accelerator: Any, start: int) -> BucketBatchSampler:
    batch_size = int(cfg.data.batch_size)
    # Batches of one never mix shapes: skip reading every image header.
    keys: list = [0] * len(samples)
    if batch_size > 1:
        index = Path(cfg.cache.dir) / "image_sizes.json" if cfg.cache.get("dir") else None
        areas = (int(cfg.data.target_pixels), int(cfg.model.vae_image_pixels), int(cfg.data.multiple_of))
        keys = bucket_keys(samples, *areas, index=index)
    return BucketBatchSampler(
        keys,
        [len(s.prompt) for s in samples],
        batch_size,
        int(cfg.train.seed),
        bool(cfg.data.shuffle),
        accelerator.num_processes,
        accelerator.process_index,
        start=start,
    )


def _step_end_hooks(cfg: DictConfig, logger: MetricsLogger, samples: list[Sample]) -> list:
    """What runs after each optimizer step: image logging; validation sampling plugs in here too."""
    hooks = []
    if cfg.logging.log_images:
        by_id = {s.id: s for s in samples}
        hooks.append(ImageLogger(logger, by_id, int(cfg.logging.log_images_every), int(cfg.logging.log_images_count)))
    return hooks


def _validation_hook(cfg: DictConfig, accelerator: Any, model: Any, source: Any, samples: list, scheduler: Any, logger):
    """Every `validation.every` steps, sample the validation inputs as inference does and log them.

    Builds the VAE (its decoder decodes the samples); the inputs come through the run's source.
    """
    from qie.models import model_spec
    from qie.stages.common import sampling_options
    from qie.stages.validation import validation_inputs, validation_samples
    from qie.training.validation import Validator

    v = cfg.validation
    options = sampling_options(
        cfg.predict, negative_prompt=v.negative_prompt, true_cfg_scale=v.true_cfg_scale,
        num_inference_steps=v.num_inference_steps, seed=v.seed,
    )  # fmt: skip
    vae = load_parts(cfg.model, ["vae"], {"vae": str(accelerator.device)}).vae
    chosen = validation_samples(v, samples, int(cfg.logging.log_images_count))
    inputs, negatives = validation_inputs(source, chosen, options.negative_prompt)
    output_image = model_spec(cfg.model.variant).output_image
    validator = Validator(inputs, negatives, scheduler, vae, logger, options, output_image)
    every = int(v.every)

    def hook(step: int, batch: Any) -> None:
        if step % every == 0:
            validator(step, accelerator.unwrap_model(model))

    return hook


def _gather_checksums(accelerator: Any, params: list[torch.nn.Parameter]) -> list[list[float]]:
    """Per process, the sum and the sum of squares of the trained weights: equal when replicas agree."""
    local = torch.stack(
        [torch.stack([p.detach().double().sum(), p.detach().double().pow(2).sum()]) for p in params if p.requires_grad]
    ).sum(0)
    gathered = accelerator.gather(local.to(accelerator.device).unsqueeze(0))
    return gathered.cpu().tolist()


def _finish(cfg: DictConfig, accelerator: Any, model: Any, run_dir: Path, result: dict, lora_mode: bool) -> None:
    """Export the trained weights and write train_result.json (main process)."""
    unwrapped = accelerator.unwrap_model(model)
    if lora_mode:
        result["lora"] = str(save_lora(unwrapped, run_dir / "lora", comfyui=bool(cfg.train.export_comfyui)))
    else:
        unwrapped.save_pretrained(run_dir / "transformer")
        result["transformer"] = str(run_dir / "transformer")
    (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2))
    if not result["ranks_agree"]:
        print(f"qie: warning: the processes' weights differ at the end: {result['param_checksums']}")
    how = "stopped by a signal" if result["stopped_by_signal"] else "trained"
    out = result.get("lora") or result.get("transformer")
    print(f"qie: {how} at step {result['step']}, last loss {result['loss']:.4f}; weights: {out}")
    if result["stopped_by_signal"]:
        print(f"qie: continue with train.resume=latest hydra.run.dir={run_dir}")
    print(f"qie: metrics {run_dir / 'metrics.jsonl'}, TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")


__all__ = ["LORA_FILE", "RESULT_FILE", "precompute_command", "run"]
