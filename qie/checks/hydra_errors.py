"""Hydra's composition errors as qie's one line: an unknown key (with the nearest valid one, or the new spelling of
an old one), a preset that does not exist (with the group's presets), a value of the wrong type or outside an enum
(naming the key), an override the grammar cannot read. What `compose()` raises and the entry points print as
`qie: error: ...` (exit 2), as they do for qie's own checks."""

from __future__ import annotations

import difflib
import re
from dataclasses import fields, is_dataclass

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from qie.checks.spellings import old_key_problem

# Hydra's "In 'experiment/mine': ..." for an error in a config file of the tree.
_IN_FILE = re.compile(r"^In '([^']+)'")


def one_line(error: HydraException) -> str:
    """The message of a Hydra composition error in one line, naming the key or group (and the config file, where a
    file of the tree set it) and what is allowed."""
    cause = error.__cause__ or error.__context__
    if isinstance(error, MissingConfigException):
        return _missing_preset(error)
    if isinstance(error, OverrideParseException):
        return f"the override {error.override!r} cannot be read: {_first_line(str(error))} (Hydra's override grammar)"
    where = _IN_FILE.match(str(error))
    place = f"{where.group(1)}.yaml: " if where else ""
    if isinstance(cause, ConfigKeyError | ConfigAttributeError) and cause.full_key:  # a key not in a schema
        return place + _unknown_key(str(cause.full_key), cause)
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        reason = _first_line(str(cause.msg or cause))
        return f"{place}{cause.full_key}: {reason}"
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip() and "hydra.cc" not in line)
    return text + (f" ({_first_line(str(cause))})" if cause is not None else "")


def _unknown_key(key: str, cause: OmegaConfBaseException) -> str:
    if problem := old_key_problem(key):
        return problem
    parent, _, name = key.rpartition(".")
    schema = cause.object_type
    valid = sorted(f.name for f in fields(schema)) if is_dataclass(schema) else []
    close = difflib.get_close_matches(name, valid, n=1)
    if close:
        return f"unknown key {key}: did you mean {parent + '.' if parent else ''}{close[0]}?"
    listed = f": valid keys of {parent!r} are {', '.join(valid)}" if valid else ""
    return f"unknown key {key}{listed}"


def _missing_preset(error: MissingConfigException) -> str:
    """`cache=nvme`: the group's presets, or a config file that is not there."""
    missing = str(error.missing_cfg_file or "")
    group, _, name = missing.rpartition("/")
    options = sorted(str(o) for o in error.options or [])
    if group and options:
        close = difflib.get_close_matches(name, options, n=1)
        hint = f" (did you mean {group}={close[0]}?)" if close else ""
        return f"{group}={name} is not a preset of {group}: choose one of {', '.join(options)}{hint}"
    return _first_line(str(error))


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), text)


__all__ = ["one_line"]
