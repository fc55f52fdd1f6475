"""A stage's form, generated from its typed schema: one input per setting (its dotted key, type, value as composed,
the schema's default, an enum's choices, the range its `problem()` states, the comment above it as help), the
presets of each config group the stage's root lists, and the settings of its objective and rewards read from their
constructors (plug-ins' too). The values are those of the config composed with the page's overrides, so the form
shows what the CLI would run.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import types
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.nodes import ValueNode

from qie.errors import QieError
from qie.studio.commands import compose
from qie.studio.notes import field_bounds, field_help

# Settings that name components: their settings come from the classes they name (`component_fields`).
COMPONENTS = ("train.objective", "eval.rewards", "validation.rewards")
# What an input of each Python type is.
_KINDS = {bool: "bool", int: "int", float: "float", str: "str"}


def stage_form(stage: str, overrides: list[str]) -> dict:
    """The form of `stage` with `overrides` applied: {"presets": [...], "groups": [{"name", "fields"}]}.

    Raises:
        ConfigError: the overrides do not compose (qie's one-line message).
    """
    from qie.config import ROOTS

    cfg = compose(stage, overrides)
    root = ROOTS[stage]
    groups = []
    for f in dataclasses.fields(root):
        kind = typing.get_type_hints(root)[f.name]
        if dataclasses.is_dataclass(kind) and f.name in cfg:
            groups.append({"name": f.name, "fields": schema_fields(kind, f.name, cfg[f.name])})
    if "train" in cfg and isinstance(cfg.train.get("objective"), DictConfig):
        groups.append({"name": "train.objective", "fields": component_fields(cfg.train.objective, "train.objective")})
    for key in COMPONENTS[1:]:
        rewards = OmegaConf.select(cfg, key, default=None)
        for name in rewards or {}:
            node, path = rewards[name], f"{key}.{name}"
            groups.append({"name": path, "fields": component_fields(node, path)})
    return {"stage": stage, "presets": presets(stage, overrides), "groups": groups}


def schema_fields(schema: type, prefix: str, node: DictConfig) -> list[dict]:
    """The inputs of the dataclass `schema` at `prefix`, valued from the composed `node`; nested dataclasses
    follow their parent's fields, and a dict or `Any` setting its composed keys (an optimizer's `weight_decay`)."""
    hints = typing.get_type_hints(schema)
    notes, bounds = field_help(schema), field_bounds(schema)
    out, nested = [], []
    for f in dataclasses.fields(schema):
        key, kind = f"{prefix}.{f.name}", hints[f.name]
        if key in COMPONENTS:
            continue  # their own groups, from their classes
        value = node._get_node(f.name) if f.name in node else None
        if dataclasses.is_dataclass(_plain(kind)) and isinstance(value, DictConfig):
            nested.extend(schema_fields(_plain(kind), key, value))
            continue
        if isinstance(value, DictConfig):
            nested.extend(mapping_fields(value, key))
            continue
        entry = describe(kind, key, _raw(value), _default(f))
        entry["help"] = notes.get(f.name) or _enum_help(kind)
        low, high = bounds.get(key, (None, None))
        entry.update({"min": low, "max": high})
        out.append(entry)
    return out + nested


def mapping_fields(node: DictConfig, prefix: str) -> list[dict]:
    """The composed keys of a free-form node (an optimizer, a scheduler, a backend), typed by their values."""
    out = []
    for name in node:
        child = node._get_node(name)
        if isinstance(child, DictConfig):
            out.extend(mapping_fields(child, f"{prefix}.{name}"))
            continue
        value = _raw(child)
        out.append(describe(type(value) if value is not None else str, f"{prefix}.{name}", value, value))
    return out


def component_fields(node: DictConfig, prefix: str) -> list[dict]:
    """A component's settings (an objective, a reward) from its class's constructor: each keyword parameter with its
    annotation and default, valued from `node`; one the node lacks is added with `+` (Hydra's new key)."""
    from qie.config.evaluation import REWARD_STAGE_KEYS as STAGE_KEYS
    from qie.config.targets import target_class

    target = str(node.get("_target_") or "")
    fields = [describe(str, f"{prefix}._target_", target, target)]
    if not target:
        return fields
    try:
        cls = target_class(f"{prefix}._target_", target, "a class")
    except QieError:  # a target that cannot be imported: composing said so; the form shows the rest
        return fields
    for param in constructor_settings(cls, skip_first=prefix == "train.objective"):
        if param.name in STAGE_KEYS and "rewards" in prefix:
            continue
        default = None if param.default is inspect.Parameter.empty else param.default
        given = param.name in node
        value = _raw(node._get_node(param.name)) if given else default
        known = next((v for v in (default, value) if v is not None), "")
        kind = param.annotation if isinstance(param.annotation, type) else type(known)
        entry = describe(kind, f"{prefix}.{param.name}", value, default)
        entry.update(add=not given, nullable=entry["nullable"] or default is None)
        fields.append(entry)
    return fields


def constructor_settings(cls: type, skip_first: bool) -> list[inspect.Parameter]:
    """The keyword parameters of `cls`'s constructors along its bases while one passes `**kwargs` on (as
    `qie.training.objectives.accepted_settings` reads them); `skip_first`: an objective's `context`/`inputs`."""
    found: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        params = list(inspect.signature(init).parameters.values())[1 + int(skip_first) :]
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                found.setdefault(p.name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return list(found.values())


def describe(kind: Any, key: str, value: Any, default: Any) -> dict:
    """One input: its key, kind ("int", "float", "bool", "str", "choice", "list", "any"), whether it may be null,
    choices of an enum, the composed value and the schema's default."""
    plain, nullable = _plain(kind), _nullable(kind)
    entry = {"key": key, "value": _jsonable(value), "default": _jsonable(default), "nullable": nullable}
    if isinstance(plain, type) and issubclass(plain, enum.Enum):
        entry.update(kind="choice", choices=[str(m.value) for m in plain])
    elif typing.get_origin(plain) in (list, tuple) or plain in (list, tuple):
        entry["kind"] = "list"
    else:
        entry["kind"] = _KINDS.get(plain, "any")
    return entry


def presets(stage: str, overrides: list[str]) -> list[dict]:
    """The config groups of the stage's root (`conf/<stage>.yaml`'s defaults list), each with its presets (the yaml
    files of its folder) and the one given in `overrides` (None: the root's or the experiment's)."""
    from qie.config.tree import conf_dir

    tree = conf_dir()
    root = OmegaConf.load(tree / f"{stage}.yaml")
    given = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in overrides if "=" in o and not o.startswith(("+", "~"))}
    out = []
    for entry in root.get("defaults", []):
        if not isinstance(entry, DictConfig) or len(entry) != 1:
            continue
        group, default = next(iter(entry.items()))
        if str(group).startswith("override") or str(group).startswith("hydra") or not (tree / group).is_dir():
            continue
        choices = sorted(p.stem for p in Path(tree / group).glob("*.yaml"))
        out.append({"group": group, "choices": choices, "default": default, "value": given.get(group)})
    return out


def _plain(kind: Any) -> Any:
    """`X` of `X | None` / `Optional[X]`."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return kind


def _nullable(kind: Any) -> bool:
    return type(None) in typing.get_args(kind)


def _raw(node: Any) -> Any:
    """A composed node's value as written (interpolations unresolved), as plain Python."""
    if node is None:
        return None
    if isinstance(node, DictConfig | ListConfig):
        return OmegaConf.to_container(node, resolve=False)
    return node._value() if isinstance(node, ValueNode) else node


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _enum_help(kind: Any) -> str:
    plain = _plain(kind)
    if not (isinstance(plain, type) and issubclass(plain, enum.Enum)) or plain.__doc__ == enum.Enum.__doc__:
        return ""
    return " ".join((plain.__doc__ or "").split())


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


__all__ = ["component_fields", "describe", "presets", "schema_fields", "stage_form"]
