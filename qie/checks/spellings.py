"""Keys of earlier releases that are spelled otherwise now, answered in one line naming the new spelling.

An override is read before Hydra composes (`old_spelling_problem`: the command line's, `compose()`'s), and a key
Hydra could not find in a composed tree (a preset file of one's own) is looked up the same way (`old_key_problem`),
so an old spelling never ends in Hydra's "not in struct". Each entry is (old key, what replaced it, the release
note's words); a key below an old one (`train.dpo.beta`) is answered by its parent's entry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"^[A-Za-z_]\w*$")


@dataclass(frozen=True)
class Renamed:
    """A key that moved: `old` (a dotted key; its children moved with it) now written as `new` (its children below
    it), with `choose`: the group choice that brings the new key (`cache=remote`), written before it."""

    old: str
    new: str
    choose: str = ""

    def answer(self, key: str, value: str | None) -> str:
        """The one line for `key` (`old` or a key below it) given `value` (None: not known, e.g. from a file)."""
        new_key = self.new + key[len(self.old) :]
        if value is None:  # a key of a config file, or one removed with ~
            return f"{key} is an old spelling: it is {new_key} now" + (f" (with {self.choose})" if self.choose else "")
        how = f"{self.choose} {new_key}={value}" if self.choose else f"{new_key}={value}"
        return f"{key} is an old spelling: write {how}"


# Renamed keys of the last releases (CHANGELOG.md): the objectives became components (train/objective=NAME with
# their settings under train.objective), the remote cache's settings moved under cache.backend.
RENAMED = (
    Renamed("train.dpo", "train.objective", "train/objective=dpo"),
    Renamed("train.distill", "train.objective", "train/objective=distill"),
    *(
        Renamed(f"cache.{key}", f"cache.backend.{key}", "cache=remote")
        for key in ("url", "endpoint_url", "storage_options", "local_dir", "local_max_gb", "lease_seconds", "retries")
    ),
    Renamed("cache.startup_check", "+cache.backend.startup_check"),
    Renamed("cache._target_", "cache.backend._target_"),
)
# Keys that named a preset by value and are a group of their own now: `train.objective=dpo` is `train/objective=dpo`.
CHOSEN_GROUPS = {"train.objective": "train/objective", "train.optimizer": "train/optimizer"}


def old_key_problem(key: str, value: str | None = None) -> str | None:
    """The one-line answer to `key` (given `value`, where known) when it is an old spelling; None when it is not."""
    key = key.lstrip("+~")
    group = CHOSEN_GROUPS.get(key)
    if group is not None and value is not None and _NAME.match(value) and value != "null":
        return f"{key}={value} is an old spelling: the preset is chosen as {group}={value} (its settings are {key}.KEY)"
    for renamed in RENAMED:
        if key == renamed.old or key.startswith(renamed.old + "."):
            return renamed.answer(key, value)
    return None


def old_spelling_problem(overrides: list[str]) -> str | None:
    """The one-line answer to the first override of `overrides` (Hydra's `key=value`, `+key=value`, `~key`) that
    uses an old spelling, or None."""
    for override in overrides:
        key, equals, value = override.partition("=")
        if problem := old_key_problem(key.strip(), value.strip() if equals else None):
            return problem
    return None


__all__ = ["CHOSEN_GROUPS", "RENAMED", "Renamed", "old_key_problem", "old_spelling_problem"]
