"""A composed config read once into its groups' schema dataclasses: what the rules of `qie.checks.validate` check.

The stages' roots (`qie.config.ROOTS`) hold different groups: a train config has `train` and `validation`, an infer
config neither, a caption config its `caption` group. `Groups` holds each group a rule reads, None where the stage
has no such group, so that a rule reads `groups.train.mode` and skips a group the stage does not have.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from qie.config.cache import CacheConfig, PrecomputeConfig
from qie.config.caption import CaptionConfig
from qie.config.data import DataConfig
from qie.config.evaluation import EvalConfig
from qie.config.export import ExportConfig, ExtractConfig
from qie.config.model import ModelConfig
from qie.config.predict import PredictConfig
from qie.config.roots import DemoConfig
from qie.config.train import LoggingConfig, TrainConfig, ValidationConfig


@dataclass
class Groups:
    """The groups of a composed config as their schemas' dataclasses (`qie.config.typed`); None: not in the stage."""

    model: ModelConfig | None = None
    data: DataConfig | None = None
    cache: CacheConfig | None = None
    train: TrainConfig | None = None
    predict: PredictConfig | None = None
    validation: ValidationConfig | None = None
    logging: LoggingConfig | None = None
    precompute: PrecomputeConfig | None = None
    caption: CaptionConfig | None = None
    demo: DemoConfig | None = None
    eval: EvalConfig | None = None
    export: ExportConfig | None = None
    extract: ExtractConfig | None = None


# The names of the groups `Groups` holds: the keys of a composed config that are read into it.
GROUP_NAMES = frozenset(f.name for f in fields(Groups))
