"""A job's command line and its checks: only qie's own stages, overrides alone (no Hydra options), the run folder
the studio's to set, and the config composed and validated as the CLI would (`qie.checks.compose`) before it is
queued. The command is an argument list, never a shell string: a value is one argument, whatever it holds.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qie.errors import ConfigError

# The stages a job may run, and the module `python -m` runs for each.
MODULES = {
    "train": "qie.train",
    "precompute": "qie.precompute",
    "eval": "qie.eval",
    "caption": "qie.caption",
    "infer": "qie.infer",
    "export": "qie.export",
    "extract_lora": "qie.extract_lora",
    "demo": "qie.demo",
    "plan": "qie.plan",
    "cache": "qie.cache_admin",
}
# Hydra's own settings a job may change: which sweeper or launcher runs a sweep, and theirs.
HYDRA_GROUPS = ("hydra/sweeper", "hydra/launcher")
HYDRA_KEYS = ("hydra.sweeper.", "hydra.launcher.")
RESUME = "train.resume=latest"

# Composing goes through Hydra's global state: one composition at a time in this process.
_COMPOSING = threading.Lock()


@dataclass(kw_only=True)
class JobRequest:
    """A job as the page (or a script) asks for it."""

    stage: str
    overrides: list[str]
    multirun: bool = False

    @classmethod
    def of(cls, body: Any) -> JobRequest:
        """The request in a JSON body `{"stage": ..., "overrides": [...], "multirun": false}`.

        Raises:
            ConfigError: a missing or ill-typed field, a stage that is not qie's, an option among the overrides.
        """
        if not isinstance(body, Mapping):
            raise ConfigError('a job is a JSON object: {"stage": "train", "overrides": ["train.max_steps=10"]}')
        stage, overrides, multirun = body.get("stage"), body.get("overrides", []), body.get("multirun", False)
        if stage not in MODULES:
            raise ConfigError(f"unknown stage {stage!r}: the studio runs qie's own stages: {', '.join(MODULES)}")
        if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
            raise ConfigError('"overrides" must be a list of strings such as "train.max_steps=10"')
        if not isinstance(multirun, bool):
            raise ConfigError('"multirun" must be true (a sweep, -m) or false')
        request = cls(stage=stage, overrides=[o.strip() for o in overrides if o.strip()], multirun=multirun)
        request.check_overrides()
        return request

    def check_overrides(self) -> None:
        """Refuse what is no override of the stage's config: Hydra's options and the run folder, which the studio
        sets.

        Raises:
            ConfigError: naming the override.
        """
        for override in self.overrides:
            if override.startswith("-"):
                raise ConfigError(
                    f"{override!r} is an option, not a setting: a job takes overrides (key=value) only; "
                    'a sweep is "multirun": true'
                )
            if "\x00" in override:
                raise ConfigError(f"{override!r} holds a NUL character: remove it")
            key = override.lstrip("+~").split("=", 1)[0]
            if key.startswith("hydra") and not (key in HYDRA_GROUPS or key.startswith(HYDRA_KEYS)):
                raise ConfigError(
                    f"{key} is not set from the studio: each job runs in its own folder under studio.home "
                    f"(Hydra's {', '.join(HYDRA_GROUPS)} and their settings may be set)"
                )

    def command(self, run_dir: str) -> list[str]:
        """The argument list that runs the job with its run (or sweep) folder `run_dir`."""
        folder = "hydra.sweep.dir" if self.multirun else "hydra.run.dir"
        sweep = ["-m"] if self.multirun else []
        return [sys.executable, "-m", MODULES[self.stage], *sweep, *self.overrides, f"{folder}={quoted(run_dir)}"]

    def resumed(self) -> JobRequest:
        """The same job continued: a training from its run folder's latest checkpoint (`train.resume=latest`); any
        other stage as it was (precompute and caption go on from what they wrote)."""
        if self.stage != "train":
            return self
        kept = [o for o in self.overrides if o.lstrip("+~").split("=", 1)[0] != "train.resume"]
        return JobRequest(stage=self.stage, overrides=[*kept, RESUME], multirun=self.multirun)


def quoted(value: str) -> str:
    """`value` as one string of Hydra's override grammar: as it is where it holds only letters, digits and `_-./:@`,
    else quoted (a path with spaces, commas or `${`)."""
    if re.fullmatch(r"[\w\-./:@]+", value) and not re.fullmatch(r"true|false|null|[-+.\d]+(e[-+]?\d+)?", value):
        return value
    # Hydra's quoted strings: backslashes escape only before a quote or at the end; `\${` keeps `${` literal.
    escaped = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value).replace("'", "\\'").replace("${", "\\${")
    return f"'{escaped}'"


def validate(request: JobRequest) -> list[Any]:
    """Compose and validate the job's config as its CLI would; a sweep's, once per value of each swept setting (the
    others at their first value). Returns the composed configs.

    Raises:
        ConfigError: qie's one-line message (Hydra's errors too, in one line).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(request.overrides)
    except HydraException as e:
        raise ConfigError(one_line(str(e))) from None
    if not request.multirun:
        return [compose(request.stage, request.overrides)]
    return [compose(request.stage, overrides) for overrides in sweep_members(parsed)]


def sweep_members(parsed: list[Any]) -> list[list[str]]:
    """Override lists that cover every value of every swept setting: all at their first value, then each value of
    each setting in turn. A sweep that cannot be listed (an Optuna `interval`) is checked without that setting."""
    from hydra.errors import HydraException

    values: list[list[str]] = []
    for override in parsed:
        if not override.is_sweep_override():
            values.append([override.input_line])
            continue
        try:
            key = override.get_key_element()
            values.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        except HydraException:
            values.append([])  # not enumerable: left to the sweeper
    first = [choices[0] for choices in values if choices]
    members = [first]
    for i, choices in enumerate(values):
        for choice in choices[1:]:
            members.append([choice if j == i else c[0] for j, c in enumerate(values) if c])
    return members


def compose(stage: str, overrides: list[str]) -> Any:
    """`qie.checks.compose`, one at a time, its message in one line.

    Raises:
        ConfigError: what the config refuses.
    """
    from omegaconf.errors import OmegaConfBaseException

    from qie import checks

    with _COMPOSING:
        try:
            return checks.compose(stage, overrides)
        except ConfigError as e:
            raise ConfigError(one_line(str(e))) from None
        except OmegaConfBaseException as e:
            raise ConfigError(one_line(str(e))) from None


# Lines of Hydra's and OmegaConf's messages that say where, not what.
_NOISE = ("full_key:", "reference_type", "object_type", "See https://hydra.cc", "Set the environment variable")


def one_line(message: str) -> str:
    """A message of several lines (Hydra's) as one: its lines that say what went wrong, joined."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if line and not line.startswith(_NOISE) and set(line) != {"^"}]
    return ": ".join(kept) if kept else message.strip()


__all__ = ["MODULES", "RESUME", "JobRequest", "compose", "one_line", "quoted", "sweep_members", "validate"]
