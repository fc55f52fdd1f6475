"""The rewards an `eval.rewards` (or `validation.rewards`) node names, each `<name>: {_target_: pkg.Cls, ...}`:
checked against the class's constructor when the config is composed (building nothing); built by
`qie.evaluation.build.build_rewards` where a stage needs them. A reward from outside qie is configured the same way.

The stage gives a constructor the keys it names of `STAGE_KEYS` (`model`: the run's `ModelConfig`, what a judge
builds its VL model from); they are not set in the config.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from qie.config.groups import Groups
from qie.config.targets import target_class
from qie.errors import ConfigError

STAGE_KEYS = ("model",)


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


def search_problem(groups: Groups) -> str | None:
    """Why `validation.search_metric` cannot be searched on (one line), or None: it names a reward of
    `validation.rewards`, measured by validation (`validation.every`) at the last step."""
    validation, train = groups.validation, groups.train
    if validation is None or validation.search_metric is None or train is None:
        return None
    name, rewards = validation.search_metric, list(validation.rewards)
    if name not in rewards:
        return f"validation.search_metric={name} is not a reward of validation.rewards ({', '.join(rewards) or 'none'})"
    every, steps = validation.every, train.max_steps
    if every <= 0 or steps % every:
        return (
            f"validation.search_metric={name} is read from the last validation: set validation.every to a "
            f"divisor of train.max_steps={steps} (now {every})"
        )
    return None


def reward_settings_problem(groups: Groups) -> str | None:
    """Why `eval.rewards`, `validation.rewards` or `validation.search_metric` cannot work (one line), or None."""
    given = {
        "eval.rewards": None if groups.eval is None else groups.eval.rewards,
        "validation.rewards": None if groups.validation is None else groups.validation.rewards,
    }
    for key, rewards in given.items():
        if problem := rewards_problem(rewards, key):
            return problem
    return search_problem(groups)


__all__ = ["STAGE_KEYS", "reward_class", "reward_settings_problem", "rewards_problem", "search_problem"]
