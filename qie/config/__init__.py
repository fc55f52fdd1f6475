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
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from qie.config.cache import (
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
from qie.config.groups import GROUP_NAMES, Groups
from qie.config.model import ModelConfig
from qie.config.predict import PredictConfig
from qie.config.rewards import reward_settings_problem
from qie.config.roots import DemoRoot, PrecomputeRoot, TrainRoot
from qie.config.rules import late_problem, setting_problem, trains_lora
from qie.config.studio import StudioRoot
from qie.config.train import TrainConfig
from qie.config.tree import conf_dir
from qie.config.weights import weight_problem
from qie.errors import ConfigError

STAGES = (
    "precompute",
    "train",
    "infer",
    "cache",
    "demo",
    "plan",
    "caption",
    "export",
    "extract_lora",
    "eval",
    "studio",
)


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
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}: choose one of {', '.join(STAGES)}")
    register(stage)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
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
    "studio": StudioRoot,
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
    is."""
    if not OmegaConf.is_config(node):
        return node
    return OmegaConf.to_object(node)


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
    """Check a composed config against its schema, its groups' ranges and the rules between them, building nothing.

    The checks of the tree as composed (keys no schema has, a preset named as a value, a package a `_target_`
    needs) come first; then the config is read once into its groups' dataclasses (`Groups`), which the ranges of
    each schema (its `problem()`) and the rules (`qie.config.rules`, `.weights`, `.rewards`) check.

    Raises:
        ConfigError: naming the key, the bad value and what is allowed.
    """
    from qie.config.backend import backend_problem, misplaced_problem

    for name, node in cfg.items():
        if name == "hydra" or not isinstance(node, DictConfig):
            continue
        if name == "cache" and (problem := misplaced_problem(node)):
            raise ConfigError(problem)  # a backend's setting written at the stages' level
        _check_keys(node, name)
        if name == "cache" and (problem := backend_problem(node)):
            raise ConfigError(problem)  # a key of cache.backend its constructor does not take
    if isinstance(cfg.get("train"), DictConfig):
        _check_optimizer(cfg.train.optimizer)
    groups = read_groups(cfg)
    own = (groups.data, groups.train, groups.model, groups.predict)
    if problem := next((p for group in own if group is not None and (p := group.problem())), None):
        raise ConfigError(problem)
    spec = None if groups.model is None else _check_model(groups.model)
    if problem := weight_problem(groups) or setting_problem(groups, spec):
        raise ConfigError(problem)
    _check_objective(groups, spec)
    if problem := reward_settings_problem(groups) or late_problem(groups):
        raise ConfigError(problem)


def read_groups(cfg: DictConfig) -> Groups:
    """The groups of `cfg` as their schemas' dataclasses (`typed`), read once.

    Raises:
        ConfigError: a mandatory value (`???`) left unset.
    """
    try:
        return Groups(**{name: typed(cfg[name]) for name in cfg.keys() if name in GROUP_NAMES})
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} is not set: give it a value (the schema has none)") from None


def _check_keys(node: DictConfig, path: str) -> None:
    """Refuse keys a schema does not have, at any depth (a `+train.lora.use_dora=true` must not pass unused).
    Nodes typed `Any` or as a dict (an optimizer's or a backend's `_target_` and its arguments, checked by their
    callers) take any key."""
    schema = OmegaConf.get_type(node)
    allowed = {f.name for f in fields(schema)} if is_dataclass(schema) else set()
    if not allowed:
        return
    extra = sorted(set(node.keys()) - allowed)
    if extra:
        raise ConfigError(f"unknown key {path}.{extra[0]}: valid keys of {path!r} are {', '.join(sorted(allowed))}")
    for key in (k for k in node.keys() if k in allowed):
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            _check_keys(child, f"{path}.{key}")


def _check_objective(groups: Groups, spec: Any) -> None:
    """`train.objective` names an objective class by `_target_` (imported, not built), its settings fit the class's
    constructor, and that objective can train this run (its `use_problem`: the model's family, the mode,
    regularisation data, its own settings)."""
    if groups.train is None or groups.train.objective is None:
        return
    objectives = importlib.import_module("qie.training.objectives")
    node = groups.train.objective
    cls = objectives.objective_class(node)
    if problem := objectives.settings_problem(cls, objectives.settings_of(node)):
        raise ConfigError(problem)
    if spec is not None:
        data = groups.data
        regularization = data is not None and bool(data.regularization.path)
        dropout = data.caption_dropout_rate if data is not None else 0.0
        lora, defaults = trains_lora(groups.train), spec.call_defaults()
        use = objectives.ObjectiveUse(spec.family, lora, regularization, {}, defaults, dropout)
        objectives.check_use(node, use)


def _check_model(model: ModelConfig) -> Any:
    """The model's variant and tiny preset exist, and its family's rules hold (`ModelFamily.config_problems`),
    before anything is built. Returns the model's spec."""
    from qie.models import model_spec, tiny_presets

    spec = model_spec(model)
    if model.tiny and model.tiny not in tiny_presets():
        raise ConfigError(f"model.tiny={model.tiny!r} is not a tiny preset: choose one of {', '.join(tiny_presets())}")
    problems = spec.family.config_problems(spec)
    if problems:
        raise ConfigError(problems[0])
    return spec


# Optional packages that a `_target_` may need, and the qie extra that installs each.
EXTRAS = {"bitsandbytes": ("bnb", "its 8-bit optimizers need a CUDA GPU")}


def _check_optimizer(node: Any) -> None:
    """`train.optimizer`, as composed: a preset named with a dot (`train.optimizer=adafactor`) sets the key to a
    string instead of choosing the preset of the nested group (`train/optimizer=adafactor`): say so; and fail at
    once, not after the model is built, when the package of its `_target_` is not installed."""
    key = "train.optimizer"
    if isinstance(node, str):
        raise ConfigError(f"{key}={node} is not a config: choose the preset with train/optimizer={node}")
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
        "or choose another optimizer, e.g. train/optimizer=adamw"
    )


__all__ = [
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
