"""The typed roots of the stages that read a whole training run's groups: train, precompute and the demo."""

from dataclasses import dataclass, field

from qie.config.cache import CacheConfig, PrecomputeConfig
from qie.config.data import DataConfig
from qie.config.model import ModelConfig
from qie.config.predict import PredictConfig
from qie.config.ranges import at_least
from qie.config.train import LoggingConfig, RunConfig, TrainConfig, ValidationConfig


@dataclass
class TrainRoot:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    run: RunConfig = field(default_factory=RunConfig)


@dataclass
class PrecomputeRoot(TrainRoot):
    """The training run's groups too: an experiment preset composes here as it does for training, and the
    teacher outputs of a distillation run (`precompute.teachers=true`) are computed with its `train.*` settings."""

    precompute: PrecomputeConfig = field(default_factory=PrecomputeConfig)


@dataclass
class DemoConfig:
    train_samples: int = 256
    heldout_samples: int = 8
    image_size: int = 64
    seed: int = 0
    # torch's intra-op threads while the demo runs (0: torch's default). The tiny model's matrices are too
    # small to gain from several; where other jobs share the cores, threads that wait on each other made a
    # training step 10-20x slower than one thread alone.
    threads: int = 1

    def problem(self) -> str | None:
        """At least one training and one held-out sample, images of 16 px or more a side (the synthetic shapes need
        the room)."""
        return at_least(
            "demo",
            [
                ("train_samples", self.train_samples, 1),
                ("heldout_samples", self.heldout_samples, 1),
                ("image_size", self.image_size, 16),
                ("threads", self.threads, 0),
            ],
        )


@dataclass
class DemoRoot(TrainRoot):
    demo: DemoConfig = field(default_factory=DemoConfig)
