"""The first half of the checks: what a composed config says of itself, read with no model library imported.

Keys no schema has (at any depth), a preset named as a value, an optimizer whose package is not installed, values
left unset, each group's ranges and choices (`problem()`), where the weights come from, and the rules between the
groups over their plain values (`qie.checks.rules`, without the model's spec). A mistake of these is answered in the
time Hydra and the schemas take to import. What needs a component's class (the cache backend's, the objective's,
a reward's) or the model's family is `qie.checks.components`, asked after these pass.
"""

from __future__ import annotations

import importlib.util
from dataclasses import fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from qie.checks.rules import late_problem, setting_problem
from qie.checks.weights import weight_problem
from qie.config.groups import GROUP_NAMES, Groups
from qie.errors import ConfigError

# Optional packages that a `_target_` may need, and the qie extra that installs each.
EXTRAS = {"bitsandbytes": ("bnb", "its 8-bit optimizers need a CUDA GPU")}


def plain_checks(cfg: DictConfig) -> tuple[Any, Groups]:
    """Check `cfg` as far as its plain values go, and read it once.

    Returns:
        The config as its root's dataclass (`OmegaConf.to_object`; the stage's `qie.config.roots` root) and its
        groups (`Groups`: the same objects by name, None for a group the stage does not have).

    Raises:
        ConfigError: naming the key, the bad value and what is allowed.
    """
    for name, node in cfg.items():
        # The cache node's own keys are checked with its backend's class (a backend's key written at the stages'
        # level is named where it goes): `qie.checks.components`.
        if name not in ("hydra", "cache") and isinstance(node, DictConfig):
            check_keys(node, name)
    if isinstance(cfg.get("train"), DictConfig):
        _check_optimizer(cfg.train.optimizer)
    root, groups = read_config(cfg)
    own = (groups.data, groups.train, groups.model, groups.predict)
    problem = next((p for group in own if group is not None and (p := group.problem())), None)
    if problem := problem or weight_problem(groups) or setting_problem(groups, None) or late_problem(groups):
        raise ConfigError(problem)
    return root, groups


def read_config(cfg: DictConfig) -> tuple[Any, Groups]:
    """`cfg` as its root's dataclass, read once, and its groups by name.

    Raises:
        ConfigError: a mandatory value (`???`) left unset.
    """
    try:
        root = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} is not set: give it a value (the schema has none)") from None
    if is_dataclass(root):
        given = {f.name: getattr(root, f.name) for f in fields(root)}
    else:  # a config made without a stage's root: its groups one by one
        given = {name: OmegaConf.to_object(cfg[name]) for name in cfg.keys() if OmegaConf.is_config(cfg[name])}
    return root, Groups(**{name: group for name, group in given.items() if name in GROUP_NAMES})


def check_keys(node: DictConfig, path: str) -> None:
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
            check_keys(child, f"{path}.{key}")


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


__all__ = ["EXTRAS", "check_keys", "plain_checks", "read_config"]
