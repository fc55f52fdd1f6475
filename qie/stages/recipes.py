"""The train and precompute stages' glue for the training recipes: the checks of `train.mask`, `train.ema` and
`data.control_dropout_rate` before anything is built, the EMA, the LoRA exports, and regularisation data
(`data.regularization`: its samples, the loss weight and its own loss in the logs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from omegaconf import DictConfig

from qie.data.mixing import REG_PREFIX
from qie.data.samples import Sample
from qie.errors import ConfigError, DataError
from qie.models import ModelSpec
from qie.stages.common import control_dropout, mask_settings, read_data
from qie.training.ema import Ema, check_ema


def check_recipes(cfg: DictConfig, lora: bool) -> None:
    """Check `train.mask`, `data.control_dropout_rate`, `train.ema` and `data.regularization` against the model
    and the mode (`lora`: a LoRA is trained), before the data is read.

    Raises:
        ConfigError: naming the key and what to do.
    """
    mask_settings(cfg)
    control_dropout(cfg)
    ema = cfg.train.get("ema")
    if ema is not None:
        fsdp, use = bool(cfg.train.get("fsdp", False)), bool(cfg.get("validation", {}).get("use_ema", False))
        check_ema(float(ema.decay), int(ema.every), lora, fsdp, use)
    regularization_settings(cfg)


def make_ema(train: DictConfig, params: list) -> Ema | None:
    """The EMA of the trained weights that `train.ema` asks for, or None."""
    ema = train.get("ema")
    if ema is None or not float(ema.decay):
        return None
    return Ema(params, float(ema.decay), int(ema.every), bool(ema.cpu))


def lora_exports(train: DictConfig) -> tuple[str, ...]:
    """The LoRA files for other tools written beside the diffusers one: `train.export_comfyui`, `export_kohya`."""
    return tuple(name for name in ("comfyui", "kohya") if bool(train.get(f"export_{name}", False)))


def regularization_settings(cfg: DictConfig) -> tuple[str, float, float] | None:
    """(path, weight, ratio) of `data.regularization`, or None when it has no path.

    Raises:
        ConfigError: a weight below 0 or a ratio outside (0, 1).
    """
    reg = cfg.data.get("regularization")
    if reg is None or not reg.path:
        return None
    weight, ratio = float(reg.weight), float(reg.ratio)
    if weight < 0:
        raise ConfigError(f"data.regularization.weight={weight} is out of range: give 0 or more")
    if not 0.0 < ratio < 1.0:
        raise ConfigError(f"data.regularization.ratio={ratio} is out of range: give the share of steps, above 0 "
                          "and below 1")  # fmt: skip
    return str(reg.path), weight, ratio


def regularization_samples(cfg: DictConfig, spec: ModelSpec | None = None, captions: Any = None) -> list[Sample]:
    """The regularisation set's samples (ids under `reg/`), those the model takes; [] without one. `captions`
    (`data.auto_caption`, see `qie.stages.auto_caption.auto_captions`) gives those without a caption theirs.

    Raises:
        DataError: the set holds no sample the model can train on.
    """
    found = regularization_settings(cfg)
    if found is None:
        return []
    dataset = read_data(cfg, path=found[0], captions=captions)
    samples = [s for s in dataset.samples if spec is None or not spec.control_problem(len(s.controls))]
    if not samples:
        raise DataError(f"data.regularization.path {found[0]!r} holds no sample model={cfg.model.name} can train on")
    return [replace(s, id=REG_PREFIX + s.id) for s in samples]


def regularization_logging(logger: Any, weight: float) -> Callable[[Any], None]:
    """A step hook logging `reg_loss` (unweighted) for the steps trained on regularisation batches."""

    def hook(info: Any) -> None:
        if info.batch.ids and all(i.startswith(REG_PREFIX) for i in info.batch.ids):
            logger.log(info.step, {"reg_loss": info.loss / weight if weight else info.loss})

    return hook
