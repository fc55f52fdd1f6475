"""The train stage's setup: what it reads from its config, read once at its edge, before anything loads.

`train_setup` takes the config groups as their schemas' dataclasses (`qie.config.typed`) and the model's spec
(`qie.components.prepare_model`), and gives the `TrainSetup` the stage's parts take: the fused base, the training
mode, the memory settings, the embedding source's settings (loss masks included), the reference dropout rate, the
regularisation set and the caption settings. The rules that need only the config were checked when it was composed
(`qie.checks.validate`); those that read files (a LoRA to fuse or go on training, a caption prompt's file) are
checked here.
"""

from __future__ import annotations

from dataclasses import dataclass

from qie.adapters.fused_base import FusedBase
from qie.adapters.lora import check_lora_file
from qie.config.data import DataConfig
from qie.config.groups import Groups
from qie.config.model import ModelConfig
from qie.config.predict import PredictConfig
from qie.config.train import LoggingConfig, TrainConfig, ValidationConfig
from qie.data.formats import DataSource
from qie.models import ModelSpec
from qie.runtime.memory import MemorySettings
from qie.stages.auto_caption import CaptionSettings, caption_settings
from qie.stages.run_outputs import RunOutputs
from qie.stages.settings import (
    Regularization,
    SourceSettings,
    data_source,
    fused_base,
    loss_masks,
    regularization,
    source_settings,
)
from qie.stages.train_model import ModelPlan
from qie.training.modes import FullMode, LoraMode, TrainMode


@dataclass(frozen=True, kw_only=True)
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
    memory: MemorySettings  # `train`'s memory levers for the model's family
    source: SourceSettings  # the embedding source's (`cache.mode`, loss masks, the precompute command)
    samples: DataSource  # where `data.path`'s samples come from
    dropout: float  # `data.control_dropout_rate`
    regularization: Regularization | None
    captions: CaptionSettings | None  # `data.auto_caption`'s prompt and generation settings, or None
    on_missing: str  # `cache.on_missing`
    run_config: dict  # the whole config as plain values: what the metrics logger records
    run_command: str = ""  # the command line that reruns the run (run_info.json)
    outputs: RunOutputs = RunOutputs()  # `run.output_url`'s store, set by the stage once opened

    @property
    def plan(self) -> ModelPlan:
        """What the trained model is built from."""
        return ModelPlan(self.model, self.train, self.memory, self.mode, self.spec, self.fused)


def train_setup(spec: ModelSpec, groups: Groups, command: str, run_config: dict) -> TrainSetup:
    """The run's setup, of a config `qie.checks.validate` passed: the fused base and the mode (a LoRA file that
    cannot be read is refused), the loss masks, the regularisation set, the caption prompt and the memory levers.

    Args:
        groups: the config's groups (`qie.checks.read_groups`): model, data, cache, train, predict, logging and
            validation are read.
        command: the precompute command that fills the cache the run reads (`qie.checks.precompute_command`).

    Raises:
        ConfigError, ModelLoadError: an unreadable `train.init_lora` or `model.fuse_loras` file, a caption prompt
        file that cannot be read.
    """
    model, data, cache, train = groups.model, groups.data, groups.cache, groups.train
    fused = fused_base(model, spec)
    mode = train_mode(train, spec, fused)
    masks = loss_masks(train, data)
    captions = caption_settings(data.auto_caption_prompt, spec) if data.auto_caption else None
    return TrainSetup(
        model=model,
        data=data,
        train=train,
        predict=groups.predict,
        logging=groups.logging,
        validation=groups.validation,
        spec=spec,
        fused=fused,
        mode=mode,
        memory=MemorySettings.of(train, spec.family),
        source=source_settings(model, data, cache, spec, masks, command),
        samples=data_source(data, cache.state_folder()),
        dropout=data.control_dropout_rate,
        regularization=regularization(data),
        captions=captions,
        on_missing=str(cache.on_missing),
        run_config=run_config,
    )


def train_mode(train: TrainConfig, spec: ModelSpec, fused: FusedBase) -> TrainMode:
    """The strategy `train.mode` names, with `train.lora`'s settings for a LoRA (or `train.init_lora`'s file); a
    LoRA's files name the base `fused`.

    Raises:
        ConfigError, ModelLoadError: an unreadable `train.init_lora`.
    """
    if train.mode == "full":
        return FullMode()
    lora, init_lora = train.lora, train.init_lora
    adapter, use_dora = str(train.adapter), bool(lora.use_dora)
    if init_lora:
        check_lora_file(init_lora, spec.family.lora_loader_class())  # before any model is built
    return LoraMode(
        rank=int(lora.rank),
        alpha=int(lora.alpha),
        target_modules=list(lora.target_modules),
        dropout=float(lora.dropout),
        init=str(lora.init),
        init_lora=str(init_lora) if init_lora else None,
        adapter=adapter,
        use_dora=use_dora,
        base=tuple(fused.record()),
    )
