"""The rewards a stage builds from an `eval.rewards` (or `validation.rewards`) node: each by `hydra.utils.instantiate`,
with its own keys (checked first, `qie.config.rewards`) and the stage's keys its constructor names."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from qie.config.rewards import STAGE_KEYS, reward_class, rewards_problem
from qie.errors import ConfigError, QieError
from qie.evaluation.reward import Reward


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


__all__ = ["build_rewards"]
