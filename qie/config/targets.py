"""The class a component's `_target_` names (a cache backend, a reward), imported while the config is checked."""

from __future__ import annotations

import importlib

from qie.errors import ConfigError, raised_at


def target_class(setting: str, target: str, expected: str) -> type:
    """The class at the dotted path `target`, set as `setting` (e.g. `cache.backend._target_`).

    Raises:
        ConfigError: naming `setting`, when nothing importable is there, the module fails as it is imported (any
            exception of its own code: a plug-in's), or it is not a class (`expected` says what should be there
            instead).
    """
    module_name, _, class_name = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name, None) if module_name else None
    except (ImportError, ValueError) as e:
        raise ConfigError(f"{setting}={target!r} cannot be imported: {e}") from None
    except Exception as e:  # the module's own code failed as it ran: a plug-in's fault, named in one line
        where = raised_at(e)
        raise ConfigError(
            f"{setting}={target!r} cannot be imported: its module {module_name} raised {e.__class__.__name__}: "
            f"{e}{where}; fix that module"
        ) from None
    if not isinstance(cls, type):
        raise ConfigError(f"{setting}={target!r} is not a class: expected {expected}")
    return cls
