"""The typed roots of the stages: a composed config of a stage is its root's dataclass (`OmegaConf.to_object`), with
its groups as their schemas' dataclasses."""

from dataclasses import dataclass, field

from qie.config.cache import CacheAction, CacheConfig, GcConfig, PrecomputeConfig, SyncConfig, VerifyConfig
from qie.config.caption import CaptionRoot
from qie.config.data import DataConfig
from qie.config.evaluation import EvalRoot
from qie.config.export import ExportRoot, ExtractRoot
from qie.config.model import ModelConfig
from qie.config.predict import PredictConfig
from qie.config.ranges import at_least
from qie.config.studio import StudioRoot
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


@dataclass
class InferRoot:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)


@dataclass
class PlanRoot:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    gpu_memory_gb: float = 24.0
    # Left for the CUDA context, cuBLAS workspaces and the caching allocator's slack.
    reserve_gb: float = 1.5


@dataclass
class CacheAdminRoot:
    cache: CacheConfig = field(default_factory=CacheConfig)
    action: CacheAction = CacheAction.stats
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    # action=gc only: the model and data set(s) whose entries are kept.
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    gc: GcConfig = field(default_factory=GcConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)


# The stages' roots by config name (`conf/<stage>.yaml`): what Hydra composes each stage's config into.
ROOTS = {
    "precompute": PrecomputeRoot,
    "train": TrainRoot,
    "infer": InferRoot,
    "cache": CacheAdminRoot,
    "demo": DemoRoot,
    "plan": PlanRoot,
    "caption": CaptionRoot,
    "export": ExportRoot,
    "extract_lora": ExtractRoot,
    "eval": EvalRoot,
    "studio": StudioRoot,
}
STAGES = tuple(ROOTS)
