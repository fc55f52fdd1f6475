"""The train stage's setup: what it reads from its config, read and checked once at its edge, before anything loads.

`train_setup` takes the config groups as their schemas' dataclasses (`qie.config.typed`) and the model's spec
(`qie.components.prepare_model`), and gives the `TrainSetup` the stage's parts take: the fused base, the training
mode, the memory settings, the embedding source's settings (loss masks included), the reference dropout rate, the
regularisation set and the caption settings. Every rule that needs no model loaded is checked here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, is_dataclass

from qie.config.cache import CacheConfig
from qie.config.data import DataConfig
from qie.config.model import ModelConfig
from qie.config.predict import PredictConfig
from qie.config.train import LoggingConfig, TrainConfig, ValidationConfig
from qie.data.formats import DataSource
from qie.errors import ConfigError
from qie.models import ModelSpec
from qie.stages.auto_caption import CaptionSettings, caption_settings
from qie.stages.recipes import check_ema_settings
from qie.stages.settings import (
    Regularization,
    SourceSettings,
    control_dropout,
    data_source,
    fused_base,
    loss_masks,
    regularization,
    source_settings,
)
from qie.training.adapters import check_options
from qie.training.fused_base import FusedBase
from qie.training.lora import check_init_name, check_lora_file
from qie.training.memory import MemorySettings
from qie.training.modes import FullMode, LoraMode, TrainMode
from qie.training.objectives import ObjectiveUse, check_use


@dataclass(frozen=True)
class TrainSetup:
    """What a training run reads from its config (the groups as their schemas' dataclasses), and what follows
    from them: read once, checked before anything loads."""

    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    predict: PredictConfig
    logging: LoggingConfig
    validation: ValidationConfig
    spec: ModelSpec
    fused: FusedBase  # `model.fuse_loras`, read and fingerprinted
    mode: TrainMode  # `train.mode`, with `train.lora`'s settings or `train.init_lora`'s file
    memory: MemorySettings  # `train`'s memory levers for the model's family, checked against the mode
    source: SourceSettings  # the embedding source's (`cache.mode`, loss masks, the precompute command)
    samples: DataSource  # where `data.path`'s samples come from
    dropout: float  # `data.control_dropout_rate`, checked against the model
    regularization: Regularization | None
    captions: CaptionSettings | None  # `data.auto_caption`'s prompt and generation settings, or None
    on_missing: str  # `cache.on_missing`
    run_config: dict  # the whole config as plain values: what the metrics logger records


def train_setup(spec: ModelSpec, model: ModelConfig, data: DataConfig, cache: CacheConfig, train: TrainConfig,
                predict: PredictConfig, logging: LoggingConfig, validation: ValidationConfig, command: str,
                run_config: dict) -> TrainSetup:  # fmt: skip
    """The run's setup, checked in the order a user fixes things: the fused base and the mode (a LoRA file that
    cannot be read), then `train.mask`, `data.control_dropout_rate`, `train.ema` and `data.regularization`, the
    objective's use, the caption prompt and the memory levers.

    Args:
        command: the precompute command that fills the cache the run reads (`qie.config.precompute_command`).

    Raises:
        ConfigError (and ModelLoadError for an unreadable `train.init_lora` or `model.fuse_loras` file).
    """
    fused = fused_base(model, spec)
    mode = train_mode(train, spec, fused)
    masks = loss_masks(train, data, spec)
    dropout = control_dropout(data, spec)
    check_ema_settings(train, bool(validation.use_ema), mode.lora)
    reg = regularization(data)
    use = ObjectiveUse(spec.family, mode.lora, reg is not None, objective_options(train))
    check_use(str(train.objective), use)  # e.g. preference pairs on a layered model: before anything loads
    captions = caption_settings(data.auto_caption_prompt, spec) if data.auto_caption else None
    memory = MemorySettings.of(train, spec.family)
    memory.check(mode.lora, str(model.quantize))
    return TrainSetup(model, data, train, predict, logging, validation, spec, fused, mode, memory,
                      source_settings(model, data, cache, spec, masks, command), data_source(data, cache.dir),
                      dropout, reg, captions, str(cache.on_missing), run_config)  # fmt: skip


def train_mode(train: TrainConfig, spec: ModelSpec, fused: FusedBase) -> TrainMode:
    """The strategy `train.mode` names, with `train.lora`'s settings for a LoRA (or `train.init_lora`'s file); a
    LoRA's files name the base `fused`.

    Raises:
        ConfigError, ModelLoadError: a `train.lora.init` peft does not know; an unreadable `train.init_lora`.
    """
    if train.mode == "full":
        if train.init_lora:
            raise ConfigError("train.init_lora needs train.mode=lora (it names a LoRA to go on training)")
        return FullMode()
    lora, init_lora = train.lora, train.init_lora
    adapter, use_dora = str(train.adapter), bool(lora.use_dora)
    check_init_name(str(lora.init))
    check_options(adapter, float(lora.dropout), str(lora.init), use_dora)
    if init_lora:
        check_lora_file(init_lora, spec.family.lora_loader_class())  # before any model is built
    return LoraMode(int(lora.rank), int(lora.alpha), list(lora.target_modules), float(lora.dropout), str(lora.init),
                    str(init_lora) if init_lora else None, adapter, use_dora, tuple(fused.record()))  # fmt: skip


def objective_options(train: TrainConfig) -> dict:
    """The `train.<objective>` settings of the objective's own, as plain values ({} where there are none)."""
    own = getattr(train, str(train.objective), None)
    return asdict(own) if is_dataclass(own) else {}
