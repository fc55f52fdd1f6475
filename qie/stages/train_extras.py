"""What the train and precompute stages add to plain training: the EMA, the LoRA exports, and regularisation
data (`data.regularization`: its samples and its own loss in the logs). `train.mask` and `data.regularization`'s
settings are read in `qie.stages.settings`; their rules, and `train.ema`'s, are checked when the config is composed
(`qie.checks.rules`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from qie.config.train import TrainConfig
from qie.data.formats import DataSource
from qie.data.mixing import REG_PREFIX
from qie.data.samples import Sample
from qie.errors import DataError
from qie.models import ModelSpec
from qie.stages.datasets import read_data
from qie.stages.settings import Regularization, at_path
from qie.training.ema import Ema


def make_ema(train: TrainConfig, params: list) -> Ema | None:
    """The EMA of the trained weights that `train.ema` asks for, or None."""
    ema = train.ema
    if ema is None or not float(ema.decay):
        return None
    return Ema(params, float(ema.decay), int(ema.every), bool(ema.cpu))


def lora_exports(train: TrainConfig) -> tuple[str, ...]:
    """The LoRA files for other tools written beside the diffusers one: `train.export_comfyui`, `export_kohya`."""
    return tuple(name for name, on in (("comfyui", train.export_comfyui), ("kohya", train.export_kohya)) if on)


def regularization_samples(
    reg: Regularization | None, source: DataSource, spec: ModelSpec, captions: Any = None
) -> list[Sample]:
    """The regularisation set's samples (ids under `reg/`, read with `source`'s settings), those the model takes;
    [] without one. `captions` (`data.auto_caption`, see `qie.stages.auto_caption.auto_captions`) gives those
    without a caption theirs.

    Raises:
        DataError: the set holds no sample the model can train on.
    """
    if reg is None:
        return []
    dataset = read_data(at_path(source, reg.path), captions=captions)
    samples = [s for s in dataset.samples if not spec.control_problem(len(s.controls))]
    if not samples:
        raise DataError(f"data.regularization.path {reg.path!r} holds no sample model={spec.name} can train on")
    return [replace(s, id=REG_PREFIX + s.id) for s in samples]


def regularization_logging(logger: Any, weight: float) -> Callable[[Any], None]:
    """A step hook logging `reg_loss` (unweighted) for the steps trained on regularisation batches."""

    def hook(info: Any) -> None:
        if info.batch.ids and all(i.startswith(REG_PREFIX) for i in info.batch.ids):
            logger.log(info.step, {"reg_loss": info.loss / weight if weight else info.loss})

    return hook
