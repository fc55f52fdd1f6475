"""The command line that reproduces a run: what a run folder's report shows.

Under the Hydra CLI it is the job's own overrides (a sweep job's, not the sweep's lists) after the entry point
that ran it. A stage run from code (the demo's training, `qie.api`) has no command line: its overrides are rebuilt
as the difference between its config and the one the stage's CLI composes from the same model and cache groups.
"""

from __future__ import annotations

import re
import shlex
import sys
from typing import Any

from omegaconf import OmegaConf

# The groups whose choice a config names (`<group>.name`): chosen on the rebuilt command line, so that the keys
# they set are not each written out.
NAMED_GROUPS = ("model", "cache")
_PLAIN = re.compile(r"^[\w./@-]*$")


def run_command(values: dict[str, Any], stage: str) -> str:
    """`python -m <entry point> <overrides>` that composes the config whose plain values (resolved) are `values` again
    (`stage`: the stage run outside the CLI)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        overrides = list(HydraConfig.get().overrides.task)
        return " ".join(["python -m", _entry_point(f"qie.{stage}"), *(shlex.quote(o) for o in overrides)])
    return " ".join([f"python -m qie.{stage}", *(shlex.quote(o) for o in rebuilt_overrides(values, stage))])


def rebuilt_overrides(values: dict[str, Any], stage: str) -> list[str]:
    """The overrides that turn the stage's composed defaults into the config of plain `values`: its group choices,
    then each key whose value differs (`+key=` where the defaults lack it, `~key` where `values` does)."""
    from qie.checks import compose  # the package this module is part of: its composing, read at call time

    groups = [f"{g}={values[g]['name']}" for g in NAMED_GROUPS if (values.get(g) or {}).get("name") is not None]
    try:  # the stage's defaults: composed, not checked (a stage checks the config it runs)
        base = compose(stage, groups, checked=False)
    except Exception:  # a group chosen from code that no yaml names: every key is written out
        groups, base = [], compose(stage, checked=False)
    now, before = _leaves(values), _leaves(OmegaConf.to_container(base, resolve=True))
    changed = [f"{k}={_value(v)}" for k, v in now.items() if k in before and before[k] != v]
    # A section the stage does not have (the demo's own, in the config it trains with) is not the stage's to read.
    sections = {k.split(".")[0] for k in before}
    added = [f"+{k}={_value(v)}" for k, v in now.items() if k not in before and k.split(".")[0] in sections]
    removed = [f"~{k}" for k in before if k not in now]
    return groups + changed + added + removed


def _entry_point(default: str) -> str:
    """The qie module `python -m` ran (`qie.demo` for `qie/demo/__main__.py`), else `default`."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = str(getattr(spec, "name", None) or "").removesuffix(".__main__")
    return name if name.startswith("qie.") else default


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf of a plain config (lists and empty mappings are leaves)."""
    if not isinstance(node, dict) or (not node and prefix):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if prefix or key != "hydra":
            out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _value(value: Any) -> str:
    """A value in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN.match(text) and text not in ("null", "true", "false") and not _is_number(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
