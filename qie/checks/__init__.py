"""The config checker: the schemas registered with Hydra, `compose()` for code and notebooks, and the checks of a
composed config, read once into what a stage's edge hands its recipe (`check` -> `Checked`).

The upper of the config's two layers: the schemas (`qie.config`) import nothing above them; this package reads
them, the rules between groups (`qie.checks.rules`, `.weights`) and the components a config names (the cache
backend, the objective, the rewards, the model's family: `qie.checks.components`). Only the entry points, the
stages and the Python API import it; nothing below the stages does.

The checks come in two halves: the plain ones first (`qie.checks.plain`: keys, ranges, choices, values left unset,
rules over plain values), which import no model library, so that a mistake on the command line is answered in the
time Hydra takes; then the components' (their classes are imported, which loads torch). Importing this package loads
Hydra's schemas and OmegaConf, nothing more.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from qie.checks.overrides import override_problem
from qie.checks.plain import plain_checks, read_config
from qie.checks.spellings import old_spelling_problem
from qie.config import ROOTS, STAGES, qie_home
from qie.config.groups import GROUP_NAMES, Groups
from qie.config.tree import conf_dir
from qie.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Checked:
    """A composed config that passed every check, read once: what a stage's edge hands its recipe.

    Args:
        root: the config as its stage's root dataclass (`qie.config.roots`: `TrainRoot`, `PlanRoot`, ...), every
            group typed.
        groups: the same groups by name (`Groups`; None for a group the stage does not have).
        values: the config as plain values, interpolations resolved: what a run records (`run_info.json`).
        precompute_command: the precompute command that fills the cache a run of this config reads.
    """

    root: Any
    groups: Groups
    values: dict[str, Any]
    precompute_command: str

    def replaced(self, group: str, **changes: Any) -> Checked:
        """A copy with the settings `changes` of `group` replaced in each view (a stage's edge deciding them, e.g.
        the demo's data and cache folders; no check is asked again: the caller keeps the rules)."""
        new = replace(getattr(self.root, group), **changes)
        groups = replace(self.groups, **{group: new}) if group in GROUP_NAMES else self.groups
        values = {**self.values, group: {**self.values[group], **changes}}
        return replace(self, root=replace(self.root, **{group: new}), groups=groups, values=values)


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


def compose(stage: str, overrides: list[str] | None = None, checked: bool = True) -> DictConfig:
    """Build the config the CLI of `stage` would build, with the same overrides syntax, and check it (`validate`).

    Args:
        stage: one of `STAGES` ("precompute", "train", "infer", "cache", "demo", "plan", "caption", "eval", ...).
        overrides: Hydra overrides such as ["model=tiny", "train.max_steps=10"].
        checked: False leaves the checks to whoever reads the config next (a stage's `run` checks what it is
            given), as the CLI composes and then checks once.

    Returns:
        The composed config (interpolations unresolved, as in the CLI).

    Raises:
        ConfigError: an unknown stage, an old spelling of a key (naming the new one), Hydra's errors for unknown
            keys, groups or bad values (one line), and every check of `validate`.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    from qie.checks.hydra_errors import one_line

    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}: choose one of {', '.join(STAGES)}")
    if problem := old_spelling_problem(list(overrides or [])) or override_problem(stage, list(overrides or [])):
        raise ConfigError(problem)
    register(stage)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = hydra_compose(config_name=stage, overrides=list(overrides or []))
    except HydraException as e:
        raise ConfigError(one_line(e)) from None
    finally:
        GlobalHydra.instance().clear()
    if checked:
        validate(cfg)
    return cfg


def validate(cfg: DictConfig) -> None:
    """Check a composed config against its schema, its groups' ranges and the rules between them, building nothing
    (`check` without keeping what it read).

    Raises:
        ConfigError: naming the key, the bad value and what is allowed.
    """
    _checked_groups(cfg)


def check(cfg: DictConfig) -> Checked:
    """Check a composed config once and read it for a stage's edge: the plain checks (no model library imported),
    then the components it names (`qie.checks.components`: their classes imported, nothing built).

    Raises:
        ConfigError: naming the key, the bad value and what is allowed.
    """
    root, groups = _checked_groups(cfg)
    values = OmegaConf.to_container(cfg, resolve=True)
    return Checked(root=root, groups=groups, values=values, precompute_command=precompute_command(cfg))


def _checked_groups(cfg: DictConfig) -> tuple[Any, Groups]:
    root, groups = plain_checks(cfg)
    # Imported once the plain checks pass: the components' classes bring torch (and a family's diffusers pipeline).
    from qie.checks.components import component_checks

    component_checks(cfg, groups)
    return root, groups


def read_groups(cfg: DictConfig) -> Groups:
    """The groups of `cfg` as their schemas' dataclasses, read once (no check).

    Raises:
        ConfigError: a mandatory value (`???`) left unset.
    """
    return read_config(cfg)[1]


def precompute_command(cfg: DictConfig) -> str:
    """The precompute command that fills the cache a run of `cfg` reads: the CLI's model/data/cache overrides
    (read from Hydra's; rebuilt from `cfg` outside the Hydra CLI)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        given = list(HydraConfig.get().overrides.task)
    except ValueError:  # not under the Hydra CLI: rebuild the essentials from the config
        given = [f"model={cfg.model.get('name')}", f"data.path={cfg.data.get('path')}"] if "data" in cfg else []
        if "cache" in cfg:
            given += [f"cache={cfg.cache.get('name')}", f"cache.dir={cfg.cache.get('dir')}"]
    groups = ("model", "data", "cache", "experiment")
    keep = [o for o in given if o.lstrip("+~").split("=")[0].split(".")[0] in groups and "cache.mode" not in o]
    return " ".join(["python -m qie.precompute", *(shlex.quote(o) for o in keep)])


__all__ = ["Checked", "check", "compose", "precompute_command", "read_groups", "register", "validate"]
