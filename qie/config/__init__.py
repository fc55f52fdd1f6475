"""Typed config roots, their registration with Hydra, and `compose()` for code and notebooks.

The YAML tree in `conf/` (the package `qie.conf`) fills these schemas; a key that is not in a schema, or a
value of the wrong type or outside an enum, fails while composing, before anything is built. The schemas are registered
with Hydra by `register()`, which `compose()` and the stage entry points call: importing this package
loads no Hydra.

The schemas' enums are `StrEnum`s: a member is its plain value (`str(m)`, an f-string, `m == "none"`, JSON), so the
code below a stage's edge takes them as the strings they are, with nothing to unwrap.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from qie.config.cache import (
    CACHE_TYPES,
    CacheAction,
    CacheConfig,
    GcConfig,
    SyncConfig,
    VerifyConfig,
)
from qie.config.caption import CaptionRoot
from qie.config.data import DataConfig
from qie.config.evaluation import EvalRoot
from qie.config.export import ExportRoot, ExtractRoot
from qie.config.model import ModelConfig
from qie.config.predict import PredictConfig
from qie.config.rewards import reward_settings_problem
from qie.config.roots import DemoRoot, PrecomputeRoot, TrainRoot
from qie.config.rules import setting_problem, trains_lora
from qie.config.train import TrainConfig
from qie.config.weights import weight_problem
from qie.errors import ConfigError

STAGES = ("precompute", "train", "infer", "cache", "demo", "plan", "caption", "export", "extract_lora", "eval")


def qie_home() -> Path:
    """Folder for qie's own files (tiny models, default cache): `$QIE_HOME` or `~/.cache/qie`."""
    return Path(os.environ.get("QIE_HOME") or Path.home() / ".cache" / "qie")


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


_STORED: dict[int, set[str]] = {}  # per ConfigStore (by id): the stages whose schema it holds


def register(*stages: str) -> None:
    """Register the schemas of `stages` (all without any) and the `qie_home` resolver with Hydra (idempotent: a
    schema is converted and stored once per process: 0.08 s for all seven, 0.02 s for the train stage alone)."""
    from hydra.core.config_store import ConfigStore

    if not OmegaConf.has_resolver("qie_home"):
        OmegaConf.register_new_resolver("qie_home", lambda: str(qie_home()))
    cs = ConfigStore.instance()
    stored = _STORED.setdefault(id(cs), set())
    for stage in stages or STAGES:
        if stage not in stored:
            cs.store(name=f"{stage}_schema", node=ROOTS[stage])
            stored.add(stage)


def compose(stage: str, overrides: list[str] | None = None) -> DictConfig:
    """Build the config the CLI of `stage` would build, with the same overrides syntax.

    Args:
        stage: one of `STAGES` ("precompute", "train", "infer", "cache", "demo", "plan", "caption", "eval").
        overrides: Hydra overrides such as ["model=tiny", "train.max_steps=10"].

    Returns:
        The composed config (interpolations unresolved, as in the CLI).

    Raises:
        ValueError: for an unknown stage; Hydra's errors for unknown keys, groups or bad values.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}: choose one of {', '.join(STAGES)}")
    register(stage)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="qie.conf", version_base=None):
            cfg = hydra_compose(config_name=stage, overrides=list(overrides or []))
    except HydraException as e:
        detail = f"\n{e.__cause__}" if e.__cause__ else ""
        raise ConfigError(f"{e}{detail}") from None
    finally:
        GlobalHydra.instance().clear()
    validate(cfg)
    return cfg


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
}


def for_stage(cfg: DictConfig, stage: str) -> DictConfig:
    """A config of `stage` made of the sections of `cfg` that stage has (e.g. a train config's model,
    data and cache as a precompute config), the rest at its defaults."""
    root = OmegaConf.structured(ROOTS[stage])
    return OmegaConf.merge(root, {k: cfg[k] for k in root.keys() if k in cfg})


def updated(cfg: DictConfig, values: dict[str, Any]) -> DictConfig:
    """A copy of `cfg` with the dotted keys of `values` set (each replacing what was there)."""
    out = cfg.copy()
    for key, val in values.items():
        OmegaConf.update(out, key, val, merge=False)
    return out


def typed(node: Any) -> Any:
    """A composed config group as its schema's dataclass (`OmegaConf.to_object`: enums as their `StrEnum` members,
    interpolations resolved), what a stage's edge hands to the code below it; a value that is no config node as it
    is. A `cache` group keeps its schema's keys only: the backend's own keys go to the backend
    (`qie.config.backend`), which the stage builds from the node itself."""
    if not OmegaConf.is_config(node):
        return node
    if OmegaConf.get_type(node) is CacheConfig:
        schema_keys = {k: node[k] for k in node.keys() if k in _CACHE_KEYS}
        node = OmegaConf.merge(OmegaConf.structured(CacheConfig), schema_keys)
    return OmegaConf.to_object(node)


_CACHE_KEYS = frozenset(f.name for f in fields(CacheConfig))


def precompute_command(cfg: DictConfig) -> str:
    """The precompute command that fills the cache a run of `cfg` reads: the CLI's model/data/cache overrides
    (read from Hydra's; rebuilt from `cfg` outside the Hydra CLI)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        given = list(HydraConfig.get().overrides.task)
    except ValueError:  # not under the Hydra CLI: rebuild the essentials from the config
        given = [f"model={cfg.model.name}", f"data.path={cfg.data.path}", f"cache={cfg.cache.name}"]
        given.append(f"cache.dir={cfg.cache.dir}")
    groups = ("model", "data", "cache", "experiment")
    keep = [o for o in given if o.lstrip("+~").split("=")[0].split(".")[0] in groups and "cache.mode" not in o]
    return " ".join(["python -m qie.precompute", *(shlex.quote(o) for o in keep)])


def validate(cfg: DictConfig) -> None:
    """Check a composed config against its schema and ranges, building nothing.

    Raises:
        ConfigError: naming the key, the bad value and what is allowed.
    """
    for name, node in cfg.items():
        if name != "hydra" and isinstance(node, DictConfig):
            _check_keys(node, name, _backend_keys(node) if name == "cache" else ())
    _check_range(cfg, "data.caption_dropout_rate", 0.0, 1.0)
    _check_range(cfg, "data.batch_size", 1, None)
    _check_range(cfg, "data.num_workers", 0, None)
    _check_range(cfg, "data.prefetch", 0, None)
    _check_range(cfg, "train.max_steps", 0, None)
    _check_range(cfg, "train.gradient_accumulation_steps", 1, None)
    _check_range(cfg, "train.learning_rate", 0.0, 3.4e38)  # what a float32 optimizer state can hold
    _check_range(cfg, "model.vae_image_pixels", 32 * 32, None)
    _check_range(cfg, "model.vl_image_pixels", 28 * 28, None)
    _check_range(cfg, "model.min_control_images", 0, None)
    _check_range(cfg, "model.max_control_images", OmegaConf.select(cfg, "model.min_control_images", default=0), None)
    _check_range(cfg, "train.blocks_to_swap", 0, None)
    _check_range(cfg, "predict.blocks_to_swap", 0, None)
    _check_group_choice(cfg, "train.optimizer")
    _check_installed(cfg, "train.optimizer")
    spec = _check_model(cfg.model) if isinstance(cfg.get("model"), DictConfig) else None
    if problem := weight_problem(cfg) or setting_problem(cfg, spec):
        raise ConfigError(problem)
    _check_objective(cfg, spec)
    if problem := reward_settings_problem(cfg):  # eval.rewards, validation.rewards and search_metric
        raise ConfigError(problem)
    if OmegaConf.select(cfg, "model.fp8_compute", default="auto") == "always" and (
        OmegaConf.select(cfg, "train.blocks_to_swap", default=0) or OmegaConf.select(cfg, "train.fsdp", default=False)
    ):
        raise ConfigError(
            "model.fp8_compute=always casts the weights on the GPU, where block swap and FSDP cannot move them: set "
            "model.fp8_compute=auto (optimum-quanto's fp8 weights then) or train.blocks_to_swap=0 and train.fsdp=false"
        )
    _check_range(cfg, "validation.heldout_samples", 0, None)
    _check_step_counts(cfg)
    for key in ("validation.every", "validation.heldout_samples"):
        if OmegaConf.select(cfg, "train.fsdp", default=False) and OmegaConf.select(cfg, key, default=0):
            raise ConfigError(
                f"{key} needs an unsharded model (the main process measures alone): set {key}=0 with train.fsdp=true"
            )


def _check_step_counts(cfg: DictConfig) -> None:
    """`validation.step_counts`: whole numbers from 1, instead of `validation.num_inference_steps` (not beside it)."""
    counts = list(OmegaConf.select(cfg, "validation.step_counts", default=None) or [])
    if counts and OmegaConf.select(cfg, "validation.num_inference_steps", default=None) is not None:
        raise ConfigError(
            "validation.step_counts and validation.num_inference_steps are both set: keep one "
            "(step_counts samples at each of its counts)"
        )
    for i, count in enumerate(counts):
        if count < 1:
            raise ConfigError(f"validation.step_counts[{i}]={count} is out of range: each count must be 1 or more")


def _backend_keys(cache: DictConfig) -> list[str]:
    """The backend's own keys of the `cache` node (see `qie.config.backend`), once its constructor takes them.

    Raises:
        ConfigError: a key neither the schema nor the backend's constructor knows.
    """
    from qie.config.backend import backend_problem, own_keys

    if problem := backend_problem(cache):
        raise ConfigError(problem)
    return own_keys(cache)


def _check_keys(node: DictConfig, path: str, own: Iterable[str] = ()) -> None:
    """Refuse keys a schema does not have, at any depth (a `+train.lora.use_dora=true` must not pass unused),
    but for `own` (a `_target_`'s own constructor arguments, checked by their caller). Nodes typed `Any` (an
    optimizer's `_target_` and its arguments) take any key."""
    schema = OmegaConf.get_type(node)
    allowed = set(getattr(schema, "__dataclass_fields__", {}))
    if not allowed:
        return
    extra = sorted(set(node.keys()) - allowed - set(own))
    if extra:
        raise ConfigError(f"unknown key {path}.{extra[0]}: valid keys of {path!r} are {', '.join(sorted(allowed))}")
    for key in (k for k in node.keys() if k in allowed):
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            _check_keys(child, f"{path}.{key}")


def _check_objective(cfg: DictConfig, spec: Any) -> None:
    """`train.objective` names an objective class by `_target_` (imported, not built), its settings fit the class's
    constructor, and that objective can train this run (its `use_problem`: the model's family, the mode,
    regularisation data, its own settings)."""
    if OmegaConf.select(cfg, "train.objective", default=None) is None:
        return
    objectives = importlib.import_module("qie.training.objectives")
    node = cfg.train.objective
    node = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    cls = objectives.objective_class(node)
    if problem := objectives.settings_problem(cls, objectives.settings_of(node)):
        raise ConfigError(problem)
    if spec is not None:
        regularization = bool(OmegaConf.select(cfg, "data.regularization.path", default=None))
        use = objectives.ObjectiveUse(spec.family, trains_lora(cfg), regularization, {}, spec.call_defaults())
        objectives.check_use(node, use)


def _check_model(model: DictConfig) -> Any:
    """The model's variant and tiny preset exist, and its family's rules hold (`ModelFamily.config_problems`),
    before anything is built. Returns the model's spec."""
    from qie.models import model_spec, tiny_presets

    spec = model_spec(model)
    tiny = model.get("tiny")
    if tiny and str(tiny) not in tiny_presets():
        raise ConfigError(f"model.tiny={tiny!r} is not a tiny preset: choose one of {', '.join(tiny_presets())}")
    problems = spec.family.config_problems(spec)
    if problems:
        raise ConfigError(problems[0])
    return spec


# Optional packages that a `_target_` may need, and the qie extra that installs each.
EXTRAS = {"bitsandbytes": ("bnb", "its 8-bit optimizers need a CUDA GPU")}


def _check_installed(cfg: DictConfig, key: str) -> None:
    """Fail at once, not after the model is built, when the package of a `_target_` is not installed."""
    node = OmegaConf.select(cfg, key, default=None)
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    if not target:
        return
    package = str(target).split(".")[0]
    try:
        installed = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken parent package
        installed = False
    if installed:
        return
    extra, note = EXTRAS.get(package, (None, None))
    how = f'pip install "qie[{extra}]" ({note})' if extra else f"pip install {package}"
    raise ConfigError(
        f"{key} ({target}) needs the package {package!r}, which is not installed: {how}; "
        f"or choose another optimizer, e.g. {key.replace('.', '/')}=adamw"
    )


def _check_group_choice(cfg: DictConfig, key: str) -> None:
    """A preset named with a dot (`train.optimizer=adafactor`) sets the key to a string instead of choosing the
    preset of the nested group (`train/optimizer=adafactor`): say so, before anything is built."""
    value = OmegaConf.select(cfg, key, default=None)
    if isinstance(value, str):
        group = key.replace(".", "/")
        raise ConfigError(f"{key}={value} is not a config: choose the preset with {group}={value}")


def _check_range(cfg: DictConfig, key: str, low: float | None, high: float | None) -> None:
    value = OmegaConf.select(cfg, key, default=None)
    if value is None:
        return
    if value != value or (low is not None and value < low) or (high is not None and value > high):  # NaN too
        bounds = f"[{low}, {high if high is not None else 'inf'}]"
        raise ConfigError(f"{key}={value} is out of range: it must lie in {bounds}")


__all__ = [
    "CACHE_TYPES",
    "STAGES",
    "compose",
    "for_stage",
    "precompute_command",
    "qie_home",
    "register",
    "typed",
    "updated",
    "validate",
]
