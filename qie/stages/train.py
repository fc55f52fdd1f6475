"""The train stage: build the transformer (+LoRA), the embedding source and the loop, then run it.

Cached mode builds only the transformer and scheduler (and the VAE, for its decoder, when images are
logged or validated); live and lazy modes build the encoders too.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from qie.components import load_parts, resolve_dtype
from qie.components.quantize import is_quantized
from qie.data.buckets import BucketBatchSampler
from qie.data.dataset import EmbeddingDataset, bucket_keys
from qie.data.samples import scan_dataset
from qie.embeddings import CachedSource
from qie.errors import ConfigError
from qie.stages.common import build_source, value
from qie.training import checkpoint as ckpt
from qie.training.logging import MetricsLogger
from qie.training.loop import LoopSettings, fit
from qie.training.lora import LORA_FILE, add_lora, load_lora_state, lora_state_dict, save_lora

LORA_STATE_FILE = "lora_state.safetensors"


def mixed_precision(cfg: DictConfig) -> str:
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
    if str(value(cfg.train.mode)) == "full":
        if is_quantized(transformer):
            raise ConfigError("train.mode=full cannot train quantized weights: set model.quantize=none")
        transformer.requires_grad_(True)
        return [p for p in transformer.parameters()]
    lora = cfg.train.lora
    return add_lora(transformer, lora.rank, lora.alpha, list(lora.target_modules), lora.dropout, lora.init)


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Train as `cfg` says, writing metrics, TensorBoard logs, checkpoints and the LoRA under `run_dir`."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from hydra.utils import instantiate

    if not cfg.data.path:
        raise ConfigError("data.path is not set: point it at a data set folder or manifest")
    run_dir = Path(run_dir)
    accelerator = Accelerator(
        mixed_precision=mixed_precision(cfg),
        gradient_accumulation_steps=int(cfg.train.gradient_accumulation_steps),
        project_dir=str(run_dir),
    )
    set_seed(int(cfg.train.seed))
    data = scan_dataset(cfg.data.path, str(value(cfg.data.format)))
    if data.problems and accelerator.is_main_process:
        for p in data.problems[:5]:
            print(f"qie: skipping sample {p.id!r}: {p.path}: {p.reason}")
    samples = data.samples
    source = build_source(cfg)

    parts = load_parts(cfg.model, ["transformer", "scheduler"], {"transformer": str(accelerator.device)})
    transformer = parts.transformer
    dtype = resolve_dtype(str(value(cfg.model.dtype)))
    if cfg.train.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    params = trainable_parameters(cfg, transformer)
    optimizer = instantiate(cfg.train.optimizer)(params, lr=float(cfg.train.learning_rate))
    lr_scheduler = instantiate(cfg.train.lr_scheduler)(optimizer)
    lora_mode = str(value(cfg.train.mode)) == "lora"
    model, optimizer = accelerator.prepare(transformer, optimizer)
    if lora_mode:
        _register_lora_state_hooks(accelerator)

    start_step, consumed = 0, 0
    resume_from = ckpt.resolve_resume(cfg.train.resume, run_dir)
    if resume_from is not None:
        accelerator.load_state(str(resume_from / "accelerate"))
        state = ckpt.read_state(resume_from)
        start_step, consumed = int(state["step"]), int(state["batches_consumed"])
        for _ in range(start_step):
            lr_scheduler.step()
        accelerator.print(f"qie: resumed from {resume_from} at step {start_step}")

    batch_size = int(cfg.data.batch_size)
    keys = (
        bucket_keys(
            samples, int(cfg.data.target_pixels), int(cfg.model.vae_image_pixels), int(cfg.data.multiple_of)
        )
        if batch_size > 1
        else [0] * len(samples)
    )
    sampler = BucketBatchSampler(
        keys,
        [len(s.prompt) for s in samples],
        batch_size,
        int(cfg.train.seed),
        bool(cfg.data.shuffle),
        accelerator.num_processes,
        accelerator.process_index,
        start=consumed,
    )
    dataset = EmbeddingDataset(samples, source, float(cfg.data.caption_dropout_rate), int(cfg.train.seed))
    # Encoders may sit on a GPU, which forked workers cannot use: only the cache is read in workers.
    workers = int(cfg.data.num_workers) if isinstance(source, CachedSource) else 0
    loader = torch.utils.data.DataLoader(
        dataset,
        sampler=sampler,
        batch_size=None,
        num_workers=workers,
        collate_fn=lambda x: x,
        persistent_workers=False,
        prefetch_factor=4 if workers else None,
    )
    logger = MetricsLogger(
        run_dir,
        str(value(cfg.logging.report_to)),
        accelerator.is_main_process,
        OmegaConf.to_container(cfg, resolve=True),
    )

    def save_checkpoint(step: int, batches_consumed: int) -> Path:
        folder = ckpt.checkpoint_dir(run_dir, step)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            tmp = ckpt.begin(folder)
        accelerator.wait_for_everyone()
        tmp = folder.with_name(f".{folder.name}.tmp")
        accelerator.save_state(str(tmp / "accelerate"))
        if accelerator.is_main_process:
            unwrapped = accelerator.unwrap_model(model)
            if lora_mode:
                save_lora(unwrapped, tmp, comfyui=bool(cfg.train.export_comfyui))
            ckpt.write_state(tmp, {"step": step, "batches_consumed": batches_consumed})
            ckpt.commit(tmp, folder)
            ckpt.prune(run_dir, cfg.train.checkpoints_total_limit)
        accelerator.wait_for_everyone()
        return folder

    result = fit(
        accelerator,
        model,
        params,
        optimizer,
        lr_scheduler,
        loader,
        dtype,
        loop_settings(cfg, parts.scheduler.config),
        logger,
        start_step=start_step,
        save_checkpoint=save_checkpoint,
    )
    logger.close()
    if accelerator.is_main_process and lora_mode:
        result["lora"] = str(
            save_lora(
                accelerator.unwrap_model(model), run_dir / "lora", comfyui=bool(cfg.train.export_comfyui)
            )
        )
        (run_dir / "train_result.json").write_text(json.dumps({k: v for k, v in result.items()}, indent=2))
        print(f"qie: trained {result['step']} steps, last loss {result['loss']:.4f}; LoRA: {result['lora']}")
        print(
            f"qie: metrics {run_dir / 'metrics.jsonl'}, TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}"
        )
    accelerator.end_training()
    return result


def _register_lora_state_hooks(accelerator) -> None:
    """Save only the LoRA weights (not the frozen base) in accelerate's state, as safetensors."""
    from safetensors.torch import load_file, save_file

    def save_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            for m in models:
                save_file(
                    lora_state_dict(accelerator.unwrap_model(m)), str(Path(output_dir) / LORA_STATE_FILE)
                )
        weights.clear()

    def load_hook(models, input_dir):
        while models:
            m = models.pop()
            load_lora_state(accelerator.unwrap_model(m), load_file(str(Path(input_dir) / LORA_STATE_FILE)))

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


__all__ = ["run", "LORA_FILE"]
