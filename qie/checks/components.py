"""The second half of the checks: the components a config names, against their classes and the model's family.

Asked once the plain checks (`qie.checks.plain`) pass. It imports the classes the config's `_target_`s name (the
cache backend, the objective, each reward) to check their settings against their constructors, and the model's
family (`qie.models.model_spec`) for the rules that depend on it; it builds nothing. Importing these classes loads
torch (and a family's diffusers pipeline): that is why this half comes second.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from qie.checks.backend import backend_problem, misplaced_problem
from qie.checks.plain import check_keys
from qie.checks.rewards import reward_settings_problem
from qie.checks.rules import setting_problem, trains_lora
from qie.config.groups import Groups
from qie.config.model import ModelConfig
from qie.errors import ConfigError
from qie.models import ModelSpec, model_spec, tiny_presets
from qie.training import objectives


def component_checks(cfg: DictConfig, groups: Groups) -> None:
    """Check the cache backend's node, the model's variant and family rules, the objective and the rewards of `cfg`
    (read as `groups`), building nothing.

    Raises:
        ConfigError: naming the key, the bad value and what is allowed.
    """
    node = cfg.get("cache")
    if isinstance(node, DictConfig):
        if problem := misplaced_problem(node):
            raise ConfigError(problem)  # a backend's setting written at the stages' level
        check_keys(node, "cache")
        if problem := backend_problem(node):
            raise ConfigError(problem)  # a key of cache.backend its constructor does not take
    spec = None if groups.model is None else _check_model(groups.model)
    if problem := setting_problem(groups, spec):
        raise ConfigError(problem)
    _check_objective(groups, spec)
    if problem := _teachers_problem(groups) or reward_settings_problem(groups):
        raise ConfigError(problem)


def _check_model(model: ModelConfig) -> ModelSpec:
    """The model's variant and tiny preset exist, and its family's rules hold (`ModelFamily.config_problems`),
    before anything is built. Returns the model's spec."""
    spec = model_spec(model)
    if model.tiny and model.tiny not in tiny_presets():
        raise ConfigError(f"model.tiny={model.tiny!r} is not a tiny preset: choose one of {', '.join(tiny_presets())}")
    problems = spec.family.config_problems(spec)
    if problems:
        raise ConfigError(problems[0])
    return spec


def _check_objective(groups: Groups, spec: Any) -> None:
    """`train.objective` names an objective class by `_target_` (imported, not built), its settings fit the class's
    constructor, and that objective can train this run (its `use_problem`: the model's family, the mode,
    regularisation data, its own settings)."""
    if groups.train is None or groups.train.objective is None:
        return
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


def _teachers_problem(groups: Groups) -> str | None:
    """`precompute.teachers` only with an objective that computes targets ahead of training (`PrecomputesTargets`:
    distillation's teacher outputs)."""
    if groups.precompute is None or not groups.precompute.teachers or groups.train is None:
        return None
    cls = objectives.objective_class(groups.train.objective)
    if issubclass(cls, objectives.PrecomputesTargets):
        return None
    return (
        f"precompute.teachers=true computes an objective's targets ahead of training, and {cls.__qualname__} "
        "(train.objective) computes none: give the training run's overrides (e.g. train/objective=distill)"
    )


__all__ = ["component_checks"]
