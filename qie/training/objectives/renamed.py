"""Names of the objective seam that were renamed or removed: importing one is answered in one line naming what
replaced it (a module's `__getattr__` asks `renamed_error`)."""

from __future__ import annotations

RENAMED = {
    "ObjectiveInputs": (
        "ObjectiveContext (qie.extend): an objective is built as cls(context, **settings) and asks the context for "
        "what it uses"
    ),
    "ScoresOwnResults": (
        "ObjectiveContext.score (qie.extend): an objective that scores its own results calls it; the progress line "
        "shows its StepMeans' reward"
    ),
}


def renamed_error(module: str, name: str) -> Exception:
    """The error for `module.name`: an ImportError naming its replacement where it was renamed (`from module import
    name` keeps its words: an AttributeError would be replaced by Python's own), else the plain missing attribute."""
    if name in RENAMED:
        return ImportError(f"{module}.{name} was replaced: use {RENAMED[name]} (CHANGELOG.md)")
    return AttributeError(f"module {module!r} has no attribute {name!r}")


__all__ = ["RENAMED", "renamed_error"]
