"""The command line's overrides read against the stage's schema and the config tree before Hydra composes: a key no
schema has and a preset no group has are answered at once, in the words Hydra's own errors get
(`qie.checks.hydra_errors`), without the time composing takes.

Only what the schema and the tree's folders say for certain is answered here; anything else (`+key`, `++key`, `~key`,
`hydra.*`, sweeps, a search path or config folder of one's own, keys under a node that takes any key) is left to
Hydra, which answers it the same way when it composes.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import fields, is_dataclass
from functools import cache
from pathlib import Path

from qie.config.roots import ROOTS
from qie.config.tree import conf_dir

# Overrides that change where presets are found, or what the tree is: the tree's folders then say nothing certain.
_OWN_TREES = ("hydra.searchpath", "--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")


def override_problem(stage: str, args: list[str]) -> str | None:
    """The one-line answer to the first override of `args` (the command line, options included) whose key the
    `stage`'s schema lacks or whose preset its group lacks; None when the overrides read well so far."""
    if any(arg.startswith(_OWN_TREES) for arg in args):
        return None
    for arg in args:
        key, equals, value = arg.partition("=")
        if not equals or arg.startswith(("+", "~", "-")) or key.startswith("hydra.") or "@" in key:
            continue
        folder = conf_dir() / key
        if folder.is_dir():
            if problem := _preset_problem(key, value, folder):
                return problem
        elif "/" not in key and (problem := _key_problem(ROOTS[stage], key)):
            return problem
    return None


def _preset_problem(group: str, value: str, folder: Path) -> str | None:
    if value in ("null", "") or any(c in value for c in ",()[]{}*$"):  # none, a sweep or a function: Hydra's
        return None
    presets = sorted(p.stem for p in folder.glob("*.yaml"))
    if value in presets:
        return None
    close = difflib.get_close_matches(value, presets, n=1)
    hint = f" (did you mean {group}={close[0]}?)" if close else ""
    return f"{group}={value} is not a preset of {group}: choose one of {', '.join(presets)}{hint}"


def _key_problem(root: type, key: str) -> str | None:
    """Why `key` (dotted) is no key of the schema `root`: its first part that no dataclass on the way names."""
    node: object = root
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if not is_dataclass(node):
            return None  # a node of any keys (an optimizer's, a backend's): its class says, later
        hints = _hints(node)
        if part not in hints:  # named as Hydra names it: the key up to the part that is not there
            where, missing = ".".join(parts[:depth]), ".".join(parts[: depth + 1])
            close = difflib.get_close_matches(part, sorted(hints), n=1)
            if close:
                return f"unknown key {missing}: did you mean {where + '.' if where else ''}{close[0]}?"
            valid = f": valid keys of {where!r} are {', '.join(sorted(hints))}" if where else ""
            return f"unknown key {missing}{valid}"
        node = _dataclass_of(hints[part])
    return None


@cache
def _hints(cls: type) -> dict[str, object]:
    names = {f.name for f in fields(cls)}
    return {name: hint for name, hint in typing.get_type_hints(cls).items() if name in names}


def _dataclass_of(hint: object) -> object:
    """The dataclass a field holds (through `X | None`), or None for a leaf or a node of any keys."""
    if is_dataclass(hint):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 and is_dataclass(args[0]) else None


__all__ = ["override_problem"]
