"""What the train stage builds besides its data: the transformer and noise scheduler (`load_model`), the objective's
context (`objective_context`: what an objective may ask the run for, each service built when first asked), the
training state over them (`build_train_state`: what the mode trains, the objective built on the model with its adapter,
the memory levers, the optimizer and LR schedule) and the records checkpoints keep (`run_records`). Precompute's
target filling (`qie.stages.teacher_fill`) builds the same pieces, so its model is the training run's."""

from __future__ import annotations

import functools
from collections.abc import Callable
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
from qie.training.objectives import Objective, build_objective
from qie.training.objectives.context import ObjectiveStore
from qie.training.objectives.run_context import RunContext
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


def objective_context(
    plan: ModelPlan,
    parts: Any,
    stores: Callable[[str], ObjectiveStore] | None = None,
    model_key: dict | None = None,
    rows: Any = None,
) -> RunContext:
    """What the run's objective may ask for (`ObjectiveContext`), with the run's noise-level sampling (the
    scheduler's shift); the decoder, rows, rewards and stores are built when the objective first asks.

    Args:
        plan: the run's model and train groups and its spec (a reward's judge is built from the model group).
        parts: what `load_model` gave: the transformer (its adapter added by `build_train_state` before the objective
            is built), the scheduler and the checkpoint's model_index.json.
        stores: the store of an entry type over the run's cache (`objective_store`); model_key: what the base is.
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
    return RunContext(
        family=spec.family,
        sigmas=sigmas,
        loss_weighting=str(train.loss_weighting),
        scheduler=scheduler,
        pipeline_config=parts.pipeline_config or {},
        sampling_defaults=spec.call_defaults(),
        model_key=model_key or {},
        transformer=parts.transformer,
        decoder=functools.partial(load_decoder, plan),
        rows=rows,
        rewards=functools.partial(objective_reward, model=plan.model),
        stores=stores,
    )


def make_objective(plan: ModelPlan, context: RunContext) -> Callable[[], Objective]:
    """What builds the objective `train.objective` names (its `_target_` and settings) over `context`: called by
    `build_train_state` once the model has its adapter."""
    return functools.partial(build_objective, plan.train.objective, context)


def objective_reward(node: Any, model: ModelConfig | None = None) -> Any:
    """The reward an objective's `reward` node names (`qie.evaluation.build`), given the run's `model` where it
    names one (a judge)."""
    return build_rewards({"reward": node}, "train.objective", **({} if model is None else {"model": model}))["reward"]


def base_model_key(model: ModelConfig, record: dict) -> dict:
    """What the base transformer computes with: the run's model record but what training changes, and the settings
    that change its outputs at load (weight quantization, `zero_cond_t`)."""
    key = {k: v for k, v in record.items() if k not in ("mode", "lora")}
    return {**key, "quantize": str(model.quantize), "zero_cond_t": model.zero_cond_t}


def loop_settings(
    train: TrainConfig, logging: LoggingConfig, objective: Objective, started: float | None = None
) -> LoopSettings:
    """The loop's settings; `started` (`time.monotonic()` when the run started) counts `train.max_minutes`."""
    deadline = None if train.max_minutes is None or started is None else started + 60 * train.max_minutes
    return LoopSettings(
        deadline=deadline,
        max_steps=train.max_steps,
        seed=train.seed,
        objective=objective,
        max_grad_norm=train.max_grad_norm,
        checkpoint_every=train.checkpoint_every,
        log_every=logging.log_every,
        on_nonfinite=str(train.on_nonfinite),
    )


def load_model(plan: ModelPlan, accelerator: Any) -> Any:
    """The transformer, with the plan's fused LoRAs (`model.fuse_loras`) fused into it, and the noise scheduler,
    built where the plan's memory settings build them (compiled where `train.compile` says)."""
    device = plan.memory.build_device(accelerator.device)
    compiled, fuse = bool(plan.train.compile), plan.fused.fuse_into
    names = ["transformer", "scheduler"]
    return load_parts(LoadSettings.of(plan.model), plan.spec, names, {"transformer": device}, compiled, fuse)


def load_decoder(plan: ModelPlan) -> Any:
    """The VAE without its encoder (latents are decoded, never encoded: its weights freed), for an objective that
    decodes its samples (`ObjectiveContext.decode`)."""
    vae = load_parts(LoadSettings.of(plan.model), plan.spec, ["vae"]).vae
    vae.encoder = torch.nn.Module()
    return vae


def build_train_state(
    plan: ModelPlan, accelerator: Any, parts: Any, objective: Callable[[], Objective] | None = None
) -> tuple[TrainState, Objective | None]:
    """The prepared transformer with what `mode` trains, its optimizer and LR schedule; and the objective.

    Args:
        plan: the model, train group, memory levers (checked against the mode) and mode.
        parts: what `load_model` gave.
        objective: builds the objective (`make_objective`), called once the model has its adapter and before it is
            wrapped: what the objective asks of its context then (a reference adapter) is added to the model.
    """
    transformer, train = parts.transformer, plan.train
    params = plan.mode.trainable(transformer)
    built = objective() if objective is not None else None
    if built is not None:
        built.prepare(transformer)
    place = apply_memory(transformer, plan.memory, accelerator.device)
    if train.compile:
        accelerator.print(compile_blocks(transformer))
    optimizer = _instantiate(train.optimizer)(params, lr=train.learning_rate)
    lr_scheduler = _instantiate(train.lr_scheduler)(optimizer)
    # The LR scheduler is not prepared: accelerate would step it once per process. Checkpoints save it.
    prepared, optimizer = accelerator.prepare(transformer, optimizer, device_placement=[place, True])
    params = [p for p in prepared.parameters() if p.requires_grad]  # FSDP replaces them by their shards
    dtype = resolve_dtype(str(plan.model.dtype))
    return TrainState(accelerator, prepared, params, optimizer, lr_scheduler, dtype), built


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
