"""The config schemas: each stage's typed root (`qie.config.roots`), its groups' dataclasses with their own ranges
(`problem()`), the class a component's `_target_` names (`qie.config.targets`) and where the YAML tree is
(`qie.config.tree`).

This is the lower of the config's two layers: it imports nothing of qie above it (no model, objective or stage, no
Hydra), so anyone may read the schemas. The checker on top of it (composing, registering the schemas with Hydra,
the rules between groups, the components' settings against their classes) is `qie.checks`, which only the entry
points, the stages and the Python API import.

The schemas' enums are `StrEnum`s: a member is its plain value (`str(m)`, an f-string, `m == "none"`, JSON), so the
code below a stage's edge takes them as the strings they are, with nothing to unwrap.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from qie.config.roots import ROOTS, STAGES
from qie.entry_types import CACHE_TYPES


def qie_home() -> Path:
    """Folder for qie's own files (tiny models, default cache): `$QIE_HOME` or `~/.cache/qie`."""
    return Path(os.environ.get("QIE_HOME") or Path.home() / ".cache" / "qie")


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


__all__ = ["CACHE_TYPES", "ROOTS", "STAGES", "for_stage", "qie_home", "typed", "updated"]
