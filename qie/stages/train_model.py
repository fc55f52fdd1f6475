"""What the train stage builds besides its data: the transformer and noise scheduler (`load_model`), the training
state over them (`build_train_state`: what the mode trains, the objective's additions, the memory levers, the optimizer
and LR schedule), the objective (`make_objective`) and the records checkpoints keep (`run_records`). Precompute's
target filling (`qie.stages.teacher_fill`) builds the same pieces, so its model is the training run's."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from qie.adapters.fused_base import FusedBase
from qie.components import LoadSettings, load_parts, resolve_dtype
from qie.config.model import ModelConfig
from qie.config.train import LoggingConfig, TrainConfig
from qie.data.samples import Sample
from qie.evaluation.build import build_rewards
from qie.models import ModelSpec
from qie.runtime.compile import compile_blocks
from qie.runtime.memory import MemorySettings, apply_memory
from qie.training.loop import LoopSettings, TrainState
from qie.training.modes import TrainMode
from qie.training.objectives import Objective, ObjectiveInputs, build_objective
from qie.training.run_record import data_record, model_record, transformer_fingerprint
from qie.training.timesteps import SigmaSampling


@dataclass(frozen=True)
class ModelPlan:
    """What the trained model is built from: the model and train groups, the memory levers for the family, the
    training mode, the model's spec and its fused base (`TrainSetup.plan`)."""

    model: ModelConfig
    train: TrainConfig
    memory: MemorySettings
    mode: TrainMode
    spec: ModelSpec
    fused: FusedBase


def make_objective(
    plan: ModelPlan, parts: Any, teachers: Any = None, model_key: dict | None = None, rows: Any = None
) -> Objective:
    """The objective `train.objective` names (its `_target_` and settings), with the run's noise-level sampling
    (the scheduler's shift).

    Args:
        plan: the run's model and train groups and its spec (a reward's judge is built from the model group).
        parts: what `load_model` gave: the scheduler, the checkpoint's model_index.json (for an objective that
            samples) and the VAE where it was loaded (its decoder alone, for an objective that decodes).
        teachers: where distillation keeps its teacher outputs (`teacher_store`); model_key: what the base is.
        rows: a sample id's row at an edit's size (`train_data.sample_rows`), for an objective that scores its edits.
    """
    train, spec, scheduler = plan.train, plan.spec, parts.scheduler
    sigmas = SigmaSampling(
        method=str(train.timestep_sampling),
        logit_mean=train.logit_mean,
        logit_std=train.logit_std,
        mode_scale=train.mode_scale,
        shift=train.shift,
        dynamic_shift=train.dynamic_shift,
        scheduler_config=dict(scheduler.config),
    )
    inputs = ObjectiveInputs(
        spec.family,
        sigmas,
        str(train.loss_weighting),
        scheduler,
        parts.pipeline_config or {},
        spec.call_defaults(),
        teachers,
        model_key or {},
        parts.vae,
        rows,
        functools.partial(objective_reward, model=plan.model),
    )
    return build_objective(train.objective, inputs)


def objective_reward(node: Any, model: ModelConfig | None = None) -> Any:
    """The reward an objective's `reward` node names (`qie.evaluation.build`), given the run's `model` where it
    names one (a judge)."""
    return build_rewards({"reward": node}, "train.objective", **({} if model is None else {"model": model}))["reward"]


def base_model_key(model: ModelConfig, record: dict) -> dict:
    """What the base transformer computes with: the run's model record but what training changes, and the settings
    that change its outputs at load (weight quantization, `zero_cond_t`)."""
    key = {k: v for k, v in record.items() if k not in ("mode", "lora")}
    return {**key, "quantize": str(model.quantize), "zero_cond_t": model.zero_cond_t}


def loop_settings(train: TrainConfig, logging: LoggingConfig, objective: Objective) -> LoopSettings:
    return LoopSettings(
        max_steps=train.max_steps,
        seed=train.seed,
        objective=objective,
        max_grad_norm=train.max_grad_norm,
        checkpoint_every=train.checkpoint_every,
        log_every=logging.log_every,
        on_nonfinite=str(train.on_nonfinite),
    )


def load_model(plan: ModelPlan, accelerator: Any, decoder: bool = False) -> Any:
    """The transformer, with the plan's fused LoRAs (`model.fuse_loras`) fused into it, and the noise scheduler,
    built where the plan's memory settings build them (compiled where `train.compile` says); with `decoder`, the
    VAE without its encoder (an objective that decodes its samples)."""
    device = plan.memory.build_device(accelerator.device)
    names = ["transformer", "scheduler", *(["vae"] if decoder else [])]
    compiled, fuse = bool(plan.train.compile), plan.fused.fuse_into
    parts = load_parts(LoadSettings.of(plan.model), plan.spec, names, {"transformer": device}, compiled, fuse)
    if decoder:
        parts.vae.encoder = torch.nn.Module()  # latents are decoded, never encoded: its weights freed
    return parts


def build_train_state(plan: ModelPlan, accelerator: Any, parts: Any, objective: Objective | None = None) -> tuple:
    """The prepared transformer with what `mode` trains, its optimizer and LR schedule; and the noise scheduler.

    Args:
        plan: the model, train group, memory levers (checked against the mode) and mode.
        parts: what `load_model` gave.
        objective: adds what it needs to the model (`Objective.prepare`) before it is wrapped.
    """
    transformer, train = parts.transformer, plan.train
    params = plan.mode.trainable(transformer)
    if objective is not None:
        objective.prepare(transformer)
    place = apply_memory(transformer, plan.memory, accelerator.device)
    if train.compile:
        accelerator.print(compile_blocks(transformer))
    optimizer = _instantiate(train.optimizer)(params, lr=train.learning_rate)
    lr_scheduler = _instantiate(train.lr_scheduler)(optimizer)
    # The LR scheduler is not prepared: accelerate would step it once per process. Checkpoints save it.
    prepared, optimizer = accelerator.prepare(transformer, optimizer, device_placement=[place, True])
    params = [p for p in prepared.parameters() if p.requires_grad]  # FSDP replaces them by their shards
    dtype = resolve_dtype(str(plan.model.dtype))
    return TrainState(accelerator, prepared, params, optimizer, lr_scheduler, dtype), parts.scheduler


def run_records(plan: ModelPlan, samples: list[Sample]) -> tuple[dict, dict]:
    """The model and data records checkpoints keep, and resume compares (see `qie.training.run_record`)."""
    m, train = plan.model, plan.train
    fingerprint = transformer_fingerprint(str(m.pretrained_model_name_or_path), m.transformer_path, m.revision)
    lora = None
    if train.mode != "full":
        keys = ("rank", "alpha", "target_modules", "dropout", "init")
        lora = {k: list(v) if isinstance(v := getattr(train.lora, k), list) else v for k in keys}
    record = model_record(plan.spec, fingerprint, str(train.mode), lora, plan.fused.record())
    return record, data_record([s.id for s in samples])


def _instantiate(node: Any) -> Any:
    from hydra.utils import instantiate

    return instantiate(node)
