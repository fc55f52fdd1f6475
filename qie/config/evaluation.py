"""Schema of the eval stage (`python -m qie.eval`): its root and its own `eval` node.

`eval.rewards` maps a metric's name to a component built by `hydra.utils.instantiate` (`_target_` and the class's
own keys, checked against its constructor when the config is composed: `qie.checks.rewards`); the names are the
keys of eval.json's `metrics`.
"""

from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from qie.config.cache import CacheConfig
from qie.config.data import DataConfig
from qie.config.model import ModelConfig
from qie.config.predict import PredictConfig
from qie.config.ranges import at_least, out_of_range
from qie.config.train import TrainConfig

# The settings a reward's constructor gets from the stage, never from its config node (`model`: the run's
# `ModelConfig`, what a judge builds its VL model from).
REWARD_STAGE_KEYS = ("model",)


@dataclass
class EvalConfig:
    # The runs side by side: `none` is the base model; each other entry a LoRA file (or its folder).
    loras: list[str] = field(default_factory=lambda: ["none"])
    # name -> {_target_: class, its own keys}: every metric and judge (see conf/eval.yaml).
    rewards: dict[str, Any] = field(default_factory=dict)
    # Each row is edited once per seed (row i at seed + i, as validation samples); the metrics average them.
    seeds: list[int] = field(default_factory=lambda: [0])
    # Where eval.json, eval.md and eval.png go: relative paths inside the run folder.
    output_dir: str = "."
    # The picture's tile size in pixels.
    tile: int = 128
    # Seconds a reward may take to score one edit (null: no limit); Ctrl-C or a stop signal never waits for a
    # reward (`qie.evaluation.reward`).
    reward_timeout: float | None = None

    def problem(self) -> str | None:
        """At least one seed, a tile of 16 px or more, outputs inside the run folder, a reward timeout from 0."""
        if not self.seeds:
            return "eval.seeds is empty: give at least one seed, e.g. 'eval.seeds=[0]'"
        where = PurePath(str(self.output_dir))
        if where.is_absolute() or ".." in where.parts:
            return (
                f"eval.output_dir={self.output_dir!r} leaves the run folder: give a folder inside it (e.g. "
                "eval.output_dir=scores), or choose the run folder itself with hydra.run.dir"
            )
        return at_least("eval", [("tile", self.tile, 16)]) or out_of_range(
            "eval.reward_timeout", self.reward_timeout, 0.0
        )


@dataclass
class EvalRoot:
    """The `train` group is there so that an experiment preset (`experiment=demo`) composes as it does for
    training; the stage reads none of it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
