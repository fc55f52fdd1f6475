"""The rewards a stage builds from an `eval.rewards` (or `validation.rewards`) node: each by `hydra.utils.instantiate`,
with its own keys (checked against its class's constructor first, `rewards_problem`: also when the config is checked,
`qie.checks`) and the stage's keys its constructor names.

The stage gives a constructor the keys it names of `STAGE_KEYS` (`model`: the run's `ModelConfig`, what a judge
builds its VL model from); they are not set in the config. A reward from outside qie is configured the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from qie.config.evaluation import REWARD_STAGE_KEYS
from qie.config.targets import target_class
from qie.errors import ConfigError, QieError
from qie.evaluation.reward import Reward

STAGE_KEYS = REWARD_STAGE_KEYS


def reward_class(key: str, target: Any) -> type:
    """The class `<key>._target_` names.

    Raises:
        ConfigError: no `_target_`, or no importable class at that dotted path.
    """
    if not target:
        raise ConfigError(f"{key} has no _target_: set {key}._target_=pkg.module.Class (a qie.extend.Reward)")
    return target_class(f"{key}._target_", target, "a dotted path to a qie.extend.Reward")


def constructor_parameters(cls: type) -> list[inspect.Parameter]:
    """The parameters `cls(...)` takes. A subclass of a `typing.Protocol` (such as `qie.extend.Reward`) without an
    `__init__` of its own reports typing's placeholder, `(*args, **kwargs)`, until its first instance replaces it
    with `object.__init__`: it takes none either way."""
    if getattr(cls.__init__, "__name__", "") == "_no_init_or_replace_init":
        return []
    return list(inspect.signature(cls).parameters.values())


def rewards_problem(node: Any, path: str) -> str | None:
    """Why the rewards of `node` (`path`: its dotted name) cannot be built as configured (one line), or None."""
    if node is None:
        return None
    if not isinstance(node, Mapping):
        return f"{path} must map names to rewards ({{name: {{_target_: pkg.Cls, ...}}}}), got {node!r}"
    for name, reward in node.items():
        key = f"{path}.{name}"
        if not isinstance(reward, Mapping):
            return f"{key} must be a mapping with _target_ (a qie.extend.Reward), got {reward!r}"
        cls = reward_class(key, reward.get("_target_"))
        params = constructor_parameters(cls)
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if any(p.kind is p.VAR_KEYWORD for p in params):
            continue
        for own in (k for k in reward.keys() if k != "_target_"):
            if own not in named or own in STAGE_KEYS:
                valid = ", ".join(sorted(named - set(STAGE_KEYS))) or "none"
                return f"unknown key {key}.{own}: {reward['_target_']}'s parameters are {valid}"
        parts = getattr(cls, "combines", None)  # a reward made of rewards: its parts' nodes are checked alike
        if parts and (problem := rewards_problem(reward.get(parts), f"{key}.{parts}")):
            return problem
    return None


def build_rewards(node: Mapping[str, Any], path: str, **stage: Any) -> dict[str, Reward]:
    """The rewards of `node` (a config node, or the plain mapping of a typed group), by name, each built by
    `hydra.utils.instantiate` with its own keys and the `stage` keys its constructor names (`STAGE_KEYS`).

    Raises:
        ConfigError: a reward that cannot be built or does not implement `qie.extend.Reward`; a reward's own
            QieError as it is.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    node = node if isinstance(node, DictConfig) else OmegaConf.create(dict(node))
    if problem := rewards_problem(node, path):
        raise ConfigError(problem)
    built = {}
    for name, reward in node.items():
        cls = reward_class(f"{path}.{name}", reward.get("_target_"))
        named = inspect.signature(cls).parameters
        args = {k: v for k, v in stage.items() if k in STAGE_KEYS and k in named}
        own = OmegaConf.to_container(reward, resolve=True)
        try:
            # Not recursive: a reward made of rewards (`Weighted`) builds its parts itself, with the stage's keys.
            obj = instantiate(own, _convert_="object", _recursive_=False, **args)
        except InstantiationException as e:
            if isinstance(e.__cause__, QieError):
                raise e.__cause__ from None
            raise ConfigError(f"{path}.{name} ({own['_target_']}) cannot be built: {e.__cause__ or e}") from None
        if not isinstance(obj, Reward):
            raise ConfigError(
                f"{path}.{name}: {own['_target_']} is not a qie.extend.Reward: subclass it (its __call__(images, "
                "controls, prompts) returns one score per image)"
            )
        built[str(name)] = obj
    return built


__all__ = ["STAGE_KEYS", "build_rewards", "constructor_parameters", "reward_class", "rewards_problem"]
